"""Every chapter, executed headless with the CPU profile through the same runner as `make run`, with every exercise
filled in by its reference solution; its outputs and the console stay quiet; and without the solutions a chapter
still runs and reports its exercises as skipped.

CI (.ci/run) runs the image test first: it executes every chapter inside the course image, with the solutions, into
this build/. With COURSE_CHAPTERS_FROM_IMAGE=1 these tests check that run's outcome, notebooks and ledgers instead
of executing each chapter a second time; where the image test did not run the chapters (Docker cannot run here),
they execute them as always."""
import json
import os
import re

import pytest

from course_lib.workbook import runner
from course_lib.paths import build_dir
from test_prose import unsupported_in_outputs

# Lines that must not reach a notebook or the console: library deprecation warnings, profiler and TensorFlow banners,
# the kernel's transport notice.
NOISE = re.compile(r"FutureWarning|DeprecationWarning|UserWarning|USDT:|oneDNN custom operations|Kernel is running over TCP")
MAX_STREAM_LINES = 40  # per cell


def noise_in(executed) -> list[str]:
    """What breaks the quiet-output rules in an executed notebook: noisy lines, cells with too much stream output."""
    found = []
    for i, cell in enumerate(json.loads(executed.read_text())["cells"]):
        lines = [ln for out in cell.get("outputs", []) if out["output_type"] == "stream"
                 for ln in "".join(out["text"]).splitlines()]
        found += [f"cell {i}: {ln[:160]}" for ln in lines if NOISE.search(ln)]
        if len(lines) > MAX_STREAM_LINES:
            found.append(f"cell {i}: {len(lines)} lines of stream output (at most {MAX_STREAM_LINES})")
    return found


def image_chapters() -> dict:
    """With COURSE_CHAPTERS_FROM_IMAGE=1, the chapters the image test ran, with their seconds ({} otherwise)."""
    report_path = build_dir() / "docker" / "image-test.json"
    if not os.environ.get("COURSE_CHAPTERS_FROM_IMAGE") or not report_path.is_file():
        return {}
    return json.loads(report_path.read_text()).get("run", {}).get("chapters", {})


def run_in_image(stem: str) -> dict | None:
    """The image test's run of this chapter (from build/runs.json, the entry whose time the image test's report
    gives), which must have had the solutions and the cpu profile; None where the image test did not run it (skipped:
    Docker cannot run here; failed before `test`; run with --only; no COURSE_CHAPTERS_FROM_IMAGE)."""
    ran = image_chapters()
    if stem not in ran:
        return None
    run = json.loads((build_dir() / "runs.json").read_text()).get(stem, {})
    assert run.get("seconds") == ran[stem], f"build/runs.json's {stem} is not the image test's run: {run}"
    assert run["profile"] == "cpu" and run.get("solutions") is True, f"the image test ran {stem} as {run}"
    return run


# The chapters whose asserted checks are shares of wall-clock time (12: the profiler's memory-bound and compute-bound
# shares, the data loader's wait): executed here, each runs alone. 02 and 10 also read the clock (runner.TIMED), but
# only for figures shown beside their prediction, never asserted: beside another test they pass, and `make run
# --jobs 2` still gives them the machine to themselves for the learner's figures.
ASSERTS_TIME_SHARES = ("12",)


# The chapters that must run in order, in one worker: a chapter and those it reads (runner.READS: 07 reads 06's
# ledger, 12 10's model), 09 and 10 (each builds build/sft, never at once), and 00 and 10, which the real book reads
# after them (tests/test_book.py). The other chapters run in the other worker's group, beside them.
IN_ORDER = sorted({"00", "09", "10", *runner.READS, *(r for read in runner.READS.values() for r in read)})


def chapter(notebook):
    """The chapters run first in the session (they are its longest work), in two groups, each in one worker and in
    order (IN_ORDER's and the rest); one that asserts shares of time and executes here runs alone (make test: two
    tests at a time, tests/conftest.py). Chapter 00 (half a minute) is the fast tier's (make test-fast); the others are
    slow."""
    group = "chapters" if notebook.stem[:2] in IN_ORDER else "chapters_apart"
    marks = [pytest.mark.xdist_group(group)] + ([] if notebook.stem.startswith("00") else [pytest.mark.slow])
    if notebook.stem[:2] in ASSERTS_TIME_SHARES and notebook.stem not in image_chapters():
        marks.append(pytest.mark.alone)
    return pytest.param(notebook, marks=marks, id=notebook.stem)


@pytest.mark.notebook
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("notebook", [chapter(nb) for nb in runner.all_notebooks()])
def test_notebook_executes(notebook, notebook_times, capfd):
    ran = run_in_image(notebook.stem)
    if ran is None:
        outcome = runner.run(profile="cpu", only=notebook.stem, solutions=True)[0]
        status, seconds, error = outcome.status, outcome.seconds, outcome.error
        console = capfd.readouterr()
        loud = [ln for ln in (console.out + console.err).splitlines() if NOISE.search(ln)]
    else:  # its console is build/docker/test.log, which the image test reads
        status, seconds, error, loud = ran["status"], ran["seconds"], ran.get("error"), []
    notebook_times.append((notebook.stem + (" (image)" if ran else ""), status, seconds))
    assert status == "ok", f"{notebook.name} failed: {error}"
    executed = build_dir() / "executed" / notebook.name
    assert not noise_in(executed), "\n".join(noise_in(executed)[:10])
    assert not loud, "the console got:\n" + "\n".join(loud[:10])
    unsupported = unsupported_in_outputs(executed)
    assert not unsupported, "compares times its spreads do not support:\n" + "\n".join(unsupported[:10])
    metrics = json.loads((build_dir() / "results" / f"{notebook.stem}.json").read_text())["metrics"]
    exercises = {k: v for k, v in metrics.items() if k.startswith("exercise_")}
    assert len(exercises) >= 3 and all(v["ok"] for v in exercises.values()), exercises


@pytest.mark.slow
@pytest.mark.notebook
@pytest.mark.timeout(600)
def test_without_solutions_a_chapter_runs_and_skips_its_exercises(tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_BUILD_DIR", str(tmp_path))
    outcome = runner.run(profile="cpu", only="00", solutions=False)[0]
    assert outcome.status == "ok", outcome.error
    metrics = json.loads((tmp_path / "results" / "00_where_does_the_memory_go.json").read_text())["metrics"]
    exercises = {k: v for k, v in metrics.items() if k.startswith("exercise_")}
    assert len(exercises) >= 3
    assert all(v["value"] == "skipped" and v["ok"] is None and v["status"] == "skipped" for v in exercises.values())
    text = (tmp_path / "executed" / "00_where_does_the_memory_go.ipynb").read_text()
    assert "skipped (replace the `...`" in text and "exercises: 0 correct, 0 not yet, 3 skipped" in text
