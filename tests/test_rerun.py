"""A chapter run twice in one kernel, as a learner runs it after editing a cell: every code cell once, then every
code cell again in the same kernel (the parameters keep the values the runner gave them), on the cpu profile with
the solutions, in the environment `make run` gives its kernels (course_lib/workbook/runner.py). The second pass finds
what a fresh kernel hides: a warm cache, a peak already reached, state left by the first pass. A measurement that can
come out 0 or negative there is reported as such, never divided by.

The single-process chapters, each passed twice whole: a second pass over the measuring cells alone would save little
(the first pass is most of the cost) and would run them out of their order. About 7.5 minutes of one worker (a 2-core
AVX2-only EPYC under the whole suite: 03 221 s, 02 110 s, 01 66 s, 04 54 s), so `make test` leaves it out and
`make test-rerun` runs it (marked `rerun`; .ci/run runs it after `make test`).
"""
from __future__ import annotations

import nbformat
import pytest

from course_lib.env import CPU_PROFILE_ENV, quiet_env
from course_lib.workbook import runner
from test_prose import unsupported_in_outputs

TWICE = ("01", "02", "03", "04")


def doubled(notebook, dst) -> None:
    """`notebook` with its code cells once more after its last cell: the parameters cell left out of the second pass
    (papermill injects the parameters once, after it), each copy a fresh cell id."""
    nb = nbformat.read(notebook, as_version=4)
    again = [nbformat.v4.new_code_cell(cell.source) for cell in nb.cells
             if cell.cell_type == "code" and "parameters" not in cell.metadata.get("tags", [])]
    nb.cells += [nbformat.v4.new_markdown_cell("## The same code cells, run again in this kernel")] + again
    nbformat.write(nb, dst)


def run_twice(notebook, tmp_path, monkeypatch) -> runner.Outcome:
    """Execute `notebook` doubled, as `make run` executes a chapter (cpu profile, solutions on), into tmp_path."""
    build = tmp_path / "build"
    for name, value in {**CPU_PROFILE_ENV, **quiet_env(), **runner.HEADLESS_ENV, "COURSE_BUILD_DIR": str(build)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("COURSE_CHAPTER", notebook.stem)
    source = tmp_path / "notebooks" / notebook.name
    source.parent.mkdir()
    doubled(notebook, source)
    return runner.execute(source, "cpu", build / "executed", solutions=True)


@pytest.mark.slow
@pytest.mark.notebook
@pytest.mark.rerun
@pytest.mark.timeout(600)
@pytest.mark.parametrize("notebook", [nb for nb in runner.all_notebooks() if nb.stem[:2] in TWICE],
                         ids=lambda nb: nb.stem[:2])
def test_a_chapter_runs_twice_in_one_kernel(notebook, tmp_path, monkeypatch):
    outcome = run_twice(notebook, tmp_path, monkeypatch)
    assert outcome.status == "ok", f"{notebook.name}, run twice in one kernel: {outcome.error}"
    unsupported = unsupported_in_outputs(tmp_path / "build" / "executed" / notebook.name)
    assert not unsupported, "compares times its spreads do not support:\n" + "\n".join(unsupported[:10])


def test_doubled_repeats_every_code_cell_but_the_parameters(tmp_path):
    notebook = next(nb for nb in runner.all_notebooks() if nb.stem[:2] == "03")
    doubled(notebook, tmp_path / notebook.name)
    before = nbformat.read(notebook, as_version=4).cells
    after = nbformat.read(tmp_path / notebook.name, as_version=4).cells
    code = [c.source for c in before if c.cell_type == "code"]
    assert [c.source for c in after[len(before) + 1:]] == code[1:]          # the parameters cell is code[0]
    assert "parameters" in before[[c.cell_type for c in before].index("code")].metadata.get("tags", [])
    assert len({c.id for c in after}) == len(after)
