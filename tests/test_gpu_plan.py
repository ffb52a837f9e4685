"""The plan of tools/gpu_run.sh on one GPU, checked without a GPU: the runner's schedule replayed on the recorded
estimates (course_lib.presets.GPU_SECONDS) starts every chapter of the first command within its budget, and a
command killed from outside in the middle of a chapter returns, in its archive, every row that chapter's ledger
had written."""
import contextlib
import json
import subprocess
import sys
import tarfile
import time

import pytest
from test_gpu_ready import TOOLS, end_run, tool, without_tensorflow

from course_lib.paths import all_notebooks
from course_lib.presets import CPU_RANK_CHAPTERS, GPU_SECONDS
from course_lib.workbook import runner

# The setup before the chapters start, on the GPU machine: the wheels' install 3-4 s, the kernel's registration ~2 s
# and the import check 10-30 s (results/h200-*/gpu_run-*.log), nvidia-smi: 45 s, with a margin
SETUP_S = 45.0


def replay(order: list[str], seconds: dict[str, float], jobs: int = 2, beside=CPU_RANK_CHAPTERS) -> dict:
    """{NN: (start, end)} as the runner (`runner.startable`, one GPU: `--jobs 2`, the CPU-rank chapters beside the
    GPU's) would run `order` if chapter NN took `seconds[NN]`; without the kernels started ahead (they only help)."""
    books = {b.stem[:2]: b for b in all_notebooks()}
    pending, running, clock, spans = [books[nn] for nn in order], {}, 0.0, {}
    while pending or running:
        for book in runner.startable(pending, list(running), jobs, beside):
            pending.remove(book)
            running[book.stem] = clock + seconds[book.stem[:2]]
            spans[book.stem[:2]] = (clock, running[book.stem])
        if not running:
            raise RuntimeError(f"nothing can start: {[b.stem for b in pending]}")
        clock = min(running.values())
        running = {k: end for k, end in running.items() if end > clock}
    return spans


def test_the_first_command_runs_the_never_run_chapters_first_and_starts_them_all_in_its_budget():
    gpu_run = tool("gpu_run")
    assert gpu_run.PLANS["1"] == ["00", "09", "11", "07", "12", "02", "05", "06", "08"]
    assert sorted(gpu_run.PLANS["1"] + gpu_run.PLANS["2"]) == sorted(gpu_run.chapter_stems())  # each once
    budget = gpu_run.LIMIT - gpu_run.RESERVE - SETUP_S
    estimates = {nn: seconds for nn, (seconds, _) in GPU_SECONDS.items()}
    spans = replay(gpu_run.PLANS["1"], estimates)
    assert set(spans) == set(gpu_run.PLANS["1"])
    late = {nn: span for nn, span in spans.items() if span[1] > budget}
    assert not late, f"past the {budget:.0f} s budget on the estimates: {late}"
    # the CPU-rank chapters run beside the GPU's: the first command takes less than its chapters one after the other
    assert max(end for _, end in spans.values()) < sum(estimates[nn] for nn in spans) - estimates["05"]


def test_the_second_command_starts_10_03_and_04_in_a_window_of_its_own():
    gpu_run = tool("gpu_run")
    budget = gpu_run.LIMIT - gpu_run.RESERVE - SETUP_S
    spans = replay(gpu_run.PLANS["2"], {nn: seconds for nn, (seconds, _) in GPU_SECONDS.items()})
    assert gpu_run.PLANS["2"][:3] == ["10", "03", "04"] and all(spans[nn][0] < budget for nn in ("10", "03", "04"))


def test_caps_are_twice_the_estimate_and_the_cpu_rank_chapters_estimates_are_measured():
    gpu_run = tool("gpu_run")
    caps = gpu_run.chapter_caps(gpu_run.PLANS["1"], "gpu", None)
    assert caps == {nn: max(60, 2 * GPU_SECONDS[nn][0]) for nn in gpu_run.PLANS["1"]}
    assert all("measured" in GPU_SECONDS[nn][1] or "wall time" in GPU_SECONDS[nn][1] for nn in CPU_RANK_CHAPTERS)


def test_the_archive_is_two_gzip_members_that_tar_reads_as_one(tmp_path):
    """What ended, compressed once; then the log and the running chapters' ledgers, rewritten at each row."""
    gpu_run = tool("gpu_run")
    build = tmp_path / "build"
    (build / "results").mkdir(parents=True)
    (build / "executed").mkdir()
    (build / "results" / "00_a.json").write_text(json.dumps({"metrics": {"x": {}}}))
    (build / "executed" / "00_a.ipynb").write_text("{}")
    (build / "runs.json").write_text("{}")
    log = gpu_run.Log(tmp_path / "gpu_run.log")
    packer = gpu_run.Packer(build, tmp_path / "gpu_run.log", tmp_path / "a.tar.gz", log)
    packer.ended(unfinished=["05"])
    for rows in (1, 2):
        (build / "results" / "05_b.json").write_text(json.dumps({"metrics": {f"r{i}": {} for i in range(rows)}}))
        packer.write(["05_b"])
        with tarfile.open(tmp_path / "a.tar.gz") as tar:
            assert len(json.load(tar.extractfile("gpu-run/results/05_b.json"))["metrics"]) == rows
    listed = subprocess.run(["tar", "tzf", str(tmp_path / "a.tar.gz")], capture_output=True, text=True, check=True)
    assert listed.stdout.split() == ["gpu-run/runs.json", "gpu-run/results/00_a.json", "gpu-run/executed/00_a.ipynb",
                                     "gpu-run/gpu_run.log", "gpu-run/results/05_b.json"]


@pytest.mark.slow
@pytest.mark.notebook
@pytest.mark.timeout(300)
def test_a_kill_in_the_middle_of_a_chapter_returns_every_row_it_had_written(tmp_path):
    """The cpu profile's dry run of chapter 00, killed from outside (SIGKILL to its process group, as a machine's time
    limit does) while 00 runs: its archive holds every row 00's ledger had a second before the kill, and nothing of
    00 that only an ended chapter has (its executed notebook, its runs.json entry)."""
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = ["bash", str(TOOLS / "gpu_run.sh"), "--profile", "cpu", "--only", "00", "--chapter-cap", "0",
           "--wheels", str(tmp_path / "wheels"), "--work", str(work), "--out", str(out)]
    proc = subprocess.Popen(cmd, env=without_tensorflow(PYTHON=sys.executable), stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT, start_new_session=True)
    results = work / "build" / "results"

    def rows() -> set:
        for path in results.glob("00_*.json"):
            with contextlib.suppress(OSError, ValueError):
                return set(json.loads(path.read_text())["metrics"])
        return set()

    try:
        deadline = time.monotonic() + 240
        while len(rows()) < 3 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        before = rows()
        time.sleep(1.0)
    finally:  # the runner and its kernel run in sessions of their own: the test ends them
        end_run(proc, work / "build")
    after = rows()
    assert len(before) >= 3, f"chapter 00's ledger never had 3 rows: {(out / 'gpu_run.log').read_text()[-3000:]}"
    archives = list(out.glob("gpu-run-cpu-*.tar.gz"))
    assert len(archives) == 1 and len(list(out.iterdir())) <= 8
    with tarfile.open(archives[0]) as tar:
        names = tar.getnames()
        ledger = next(n for n in names if n.startswith("gpu-run/results/00_"))
        packed = set(json.load(tar.extractfile(ledger))["metrics"])
    assert before <= packed <= after, (sorted(before - packed), sorted(packed - after))
    assert "gpu-run/runs.json" not in names and not [n for n in names if n.startswith("gpu-run/executed/")]


def test_a_reference_run_of_an_earlier_chapter_is_marked_stale_with_the_commit_it_ran(tmp_path, monkeypatch):
    """A reference run's executed notebook is compared with the chapter now, code cell by code cell (by id, papermill's
    parameters aside): the committed chapter-10 run imports a module that has moved since, and the book says so."""
    import nbformat

    from course_lib import paths
    from course_lib.workbook import book, report

    refs = report.references()
    label = "h200-torch2.11-transformers5.17"
    note = report.stale_note(refs[label], "10_full_finetuning")
    assert note.startswith("stale: ran commit 641b1b2;") and "code cells have changed since" in note
    assert "from course_lib.evaluation import" in (refs[label]["dir"] / "executed" / "10_full_finetuning.ipynb").read_text()

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1", id="a"),
                                         nbformat.v4.new_markdown_cell("text", id="b"),
                                         nbformat.v4.new_code_cell("y = 2", id="c")])
    (tmp_path / "notebooks").mkdir()
    nbformat.write(nb, tmp_path / "notebooks" / "99_demo.ipynb")
    ref = {"dir": tmp_path / "ref", "runs": {"99_demo": {"commit": "abc1234"}}, "ledgers": {}}
    (ref["dir"] / "executed").mkdir(parents=True)
    injected = nbformat.v4.new_code_cell("profile = 'gpu'", id="p", metadata={"tags": ["injected-parameters"]})
    nb.cells.insert(0, injected)
    nbformat.write(nb, ref["dir"] / "executed" / "99_demo.ipynb")
    monkeypatch.setattr(paths, "NOTEBOOKS", tmp_path / "notebooks")
    assert report.stale_note(ref, "99_demo") == ""  # the same code: not stale (markdown and parameters aside)
    nb.cells[-1].source = "y = 3"
    nbformat.write(nb, tmp_path / "notebooks" / "99_demo.ipynb")
    assert report.stale_note(ref, "99_demo") == "stale: ran commit abc1234; 1 of the chapter's 2 code cells have changed since"
    shelves = [book._Shelf("", ["99_demo"], {}, {}, "", []), book._Shelf("gpu", ["99_demo"], ref, {}, "../", [])]
    assert "stale: ran commit abc1234" in book._other_runs(shelves[1], "99_demo", shelves)
    assert "(stale: an earlier version of this chapter)" in book._other_runs(shelves[0], "99_demo", shelves)
