"""Exercises (course_lib.workbook.exercises) and the ledger's section tables: answers checked without a traceback, the
reference solutions complete, and every chapter with at least three exercises wired to them."""
import json
import re

import pytest

import course_lib as cl
from course_lib.workbook import exercises as E
from course_lib.workbook import results
from course_lib.paths import REPO_ROOT

NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def cells(path):
    return json.loads(path.read_text())["cells"]


@pytest.fixture
def ledger(tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_BUILD_DIR", str(tmp_path))
    return cl.Ledger("99_test", profile="cpu", device="cpu")


@pytest.fixture
def ex(ledger, tmp_path, monkeypatch):
    (tmp_path / "99.py").write_text('# %% answer\n# hint: six times seven\n# rel: 0.01\nanswer = 6 * base\n\n'
                                    '# %% broken\nbroken = undefined_name\n')
    monkeypatch.setattr(E, "SOLUTIONS", tmp_path)
    return E.Exercises(ledger)


@pytest.fixture
def namespace(monkeypatch):
    ns = {"base": 7}
    monkeypatch.setattr(E, "_notebook_namespace", lambda: ns)
    return ns


@pytest.mark.parametrize("given, word", [(..., "skipped"), (42, "correct"), (42.3, "correct"), (41, "not yet"),
                                         ("forty-two", "not yet")])
def test_a_check_says_correct_not_yet_or_skipped_and_never_raises(ex, namespace, ledger, capsys, given, word):
    namespace["answer"] = given
    ex.check("answer")
    out = capsys.readouterr().out
    assert ex.outcomes["answer"] == word and word in out
    assert ("hint: six times seven" in out) == (word == "not yet")
    entry = ledger.data["metrics"]["exercise_answer"]
    assert entry["value"] == word and entry["ok"] == {"correct": True, "not yet": False}.get(word)
    assert entry.get("status") == ("skipped" if word == "skipped" else None)


def test_an_answer_never_assigned_is_skipped_and_a_broken_reference_is_not_yet(ex, namespace, capsys):
    ex.check("answer")  # the learner never ran the cell: no NameError
    assert ex.outcomes["answer"] == "skipped"
    namespace["broken"] = 1
    ex.check("broken")
    assert ex.outcomes["broken"] == "not yet" and "NameError" in capsys.readouterr().out


def test_the_reference_runs_on_a_copy_of_the_notebook(ex, namespace):
    namespace["answer"] = 42
    ex.check("answer")
    assert namespace == {"base": 7, "answer": 42}


def test_with_solutions_a_wrong_reference_fails_the_notebook(ledger, tmp_path, monkeypatch, namespace):
    (tmp_path / "99.py").write_text("# %% answer\nanswer = 1\n")
    monkeypatch.setattr(E, "SOLUTIONS", tmp_path)
    ex = E.Exercises(ledger, solutions=True)  # outside IPython: no cell to fill, the check still runs
    namespace["answer"] = 2
    with pytest.raises(AssertionError, match="did not check out"):
        ex.check("answer")


@pytest.mark.parametrize("answer, expected, ok", [
    (0.1 + 0.2, 0.3, True), ([1, 2.0], (1, 2), True), ({"a": 1}, {"a": 1.0}, True), ({"a": 1}, {"b": 1}, False),
    (" Mixed_Float16 ", "mixed_float16", True), (True, 1, True), (float("nan"), 1.0, False), ("1", 1, False),
    (__import__("torch").tensor(0.3000001), 0.3, True)])
def test_same(answer, expected, ok):
    assert E.same(answer, expected) is ok


@pytest.mark.parametrize("answer, expected, ok", [
    (13.8, 13.76, True), (13.7, 13.76, False), (0.000145, 0.000144832, True), (14.2, 14.19, True),
    (__import__("numpy").float32(14.19), 14.19, True), (__import__("numpy").array([0.4, 0.6]), [0.4, 0.6], True),
    (__import__("torch").tensor([1, 2]), [1, 2], True), (__import__("torch").tensor([3.0]), 3.0, True),
    (1001, 1000, False), (1000.0, 1000, True), ("H-200", "h200", True), ({"Eager": 1}, {"eager": 1}, True)])
def test_same_compares_number_like_answers_by_value_to_three_significant_figures(answer, expected, ok):
    assert E.same(answer, expected) is ok


def test_a_printed_digit_widens_the_band_and_aliases_accept_other_spellings():
    assert E.same(0.083, 1 / 12, printed=0.001) and not E.same(0.083, 1 / 12)
    assert E.same("H200", "141 GB (H200)", aliases={"141 GB (H200)": ["H200"]})
    assert not E.same("H100", "141 GB (H200)", aliases={"141 GB (H200)": ["H200"]})


@pytest.fixture
def tricky(ledger, tmp_path, monkeypatch):
    (tmp_path / "99.py").write_text("# %% inverse\n# hint: the general nudge\n# exact: as 2.0**-k\n"
                                    "# mistake: 1 / 65504 :: not the largest fp16 value\n"
                                    "# mistake: 2.0**16 :: solve for the norm\ninverse = 2.0**-16\n")
    monkeypatch.setattr(E, "SOLUTIONS", tmp_path)
    return E.Exercises(ledger)


@pytest.mark.parametrize("given, word, says", [
    (2.0**-16, "correct", ""), (1 / 65504, "not yet", "not the largest fp16 value"),
    (65500, "not yet", "solve for the norm"), (1.53e-5, "not yet", "give it exactly (as 2.0**-k)"),
    (0.5, "not yet", "the general nudge")])
def test_a_named_mistake_gets_its_own_hint_and_one_inside_the_band_asks_for_the_exact_form(
        tricky, namespace, capsys, given, word, says):
    namespace["inverse"] = given
    tricky.check("inverse")
    out = capsys.readouterr().out
    assert tricky.outcomes["inverse"] == word and says in out


def test_compare_shows_prediction_beside_measurement(ledger, capsys):
    E.compare(..., 16.0, "B", name="x", ledger=ledger)
    assert "no prediction" in capsys.readouterr().out
    E.compare(12, 16.0, "B", name="x", ledger=ledger)
    assert "you predicted 12 B; measured 16 B; off by 25%" in capsys.readouterr().out
    assert ledger["predicted_x"] == 12 and ledger["measured_x"] == 16.0


def test_solutions_mode_fills_the_learners_cell_in_ipython(ledger, tmp_path, monkeypatch):
    from IPython.core.interactiveshell import InteractiveShell

    (tmp_path / "99.py").write_text("# %% answer\nanswer = 6 * 7\n")
    monkeypatch.setattr(E, "SOLUTIONS", tmp_path)
    shell = InteractiveShell.instance()
    try:
        E.Exercises(ledger, solutions=True)
        shell.run_cell("# Exercise answer: what is six times seven?\nanswer = ...\n")
        assert shell.user_ns["answer"] == 42
        shell.run_cell("# not an exercise\nother = ...\n")
        assert shell.user_ns["other"] is ...
    finally:
        shell.input_transformers_post.clear()
        InteractiveShell.clear_instance()


def test_checks_are_shown_as_one_table_per_section_in_ipython(tmp_path, monkeypatch):
    from IPython.core.interactiveshell import InteractiveShell

    nb = {"cells": [{"cell_type": "markdown", "source": "## 1. one"},
                    {"cell_type": "code", "source": "ledger.check('a', 1, expect=1)"},
                    {"cell_type": "code", "source": "ledger.check('b', 2, expect=2)"},
                    {"cell_type": "markdown", "source": "## 2. two"},
                    {"cell_type": "code", "source": "ledger.check('c', 3, expect=3)"}]}
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks" / "99_sections.ipynb").write_text(json.dumps(nb))
    monkeypatch.setattr(results, "REPO_ROOT", tmp_path)
    monkeypatch.setenv("COURSE_BUILD_DIR", str(tmp_path))
    shown = []
    monkeypatch.setattr(results._SectionTables, "show", lambda self: (shown.append([r[1] for r in self.rows]),
                                                                     self.rows.clear()))
    shell = InteractiveShell.instance()
    try:
        shell.user_ns["ledger"] = cl.Ledger("99_sections", profile="cpu", device="cpu")
        for cell in nb["cells"]:
            if cell["cell_type"] == "code":
                shell.run_cell(cell["source"])
        shell.run_cell("ledger.check('d', 4, expect=4)  # a cell the notebook file does not have")
        assert shown == [["a", "b"], ["c"], ["d"]]
    finally:
        results._SectionTables._active.shell.events.unregister("post_run_cell", results._SectionTables._active._after_cell)
        results._SectionTables._active = None
        InteractiveShell.clear_instance()


def test_outside_jupyter_a_check_prints_its_line(ledger, capsys):
    ledger.check("x", 1.0, "B", expect=1.0)
    assert capsys.readouterr().out.startswith("ok   x = 1 B")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_chapter_has_three_exercises_wired_to_reference_solutions(path):
    code = ["".join(c["source"]) for c in cells(path) if c["cell_type"] == "code"]
    assert re.search(r"^solutions = False\b", code[0], re.M), "the parameters cell must set `solutions = False`"
    names = [m.group(1) for src in code if (m := E._HEADER.match(src))]
    refs = E.load_references(path.stem)
    assert len(names) >= 3, f"{path.stem}: {len(names)} exercises"
    assert sorted(names) == sorted(refs), f"{path.stem}: cells {sorted(names)} vs references {sorted(refs)}"
    for name in names:
        learner = next(src for src in code if src.startswith(f"# Exercise {name}:"))
        assert re.search(rf"^{name} = \.\.\.$", learner, re.M), f"{name}: the learner's cell must start as `...`"
        assert f'ex.check("{name}")' in code, f"{name}: no check cell"
        assert refs[name].hint, f"{name}: a reference needs a hint"
    assert any("cl.exercises.compare(" in src for src in code), f"{path.stem}: no predict-then-run comparison"
