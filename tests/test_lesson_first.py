"""Every chapter opens with its lesson: the first Markdown cell says what the learner will be able to do, the formula
that carries it, where this run's headline number shows, and which sections are the core path. Sources (titles,
authors, quotes, links) belong to "Sources and setup" at the end, never to the first screen. Reads the notebooks'
JSON only: a fraction of a second."""
from __future__ import annotations

import json
import re

import pytest

from course_lib.paths import all_notebooks

# The source articles' authors, and what names a source rather than a lesson.
AUTHORS = ("一颗普通的眼球", "征途阿韦", "Rajbhandari", "Hu et al", "Narayanan", "Shoeybi", "Micikevicius")
SOURCE = re.compile(r"“|”|https?://|\]\(|[\u4e00-\u9fff]|\bet al\b|\bblog\b|\barticle\b|\bthe (?:fine-tuning|7B) guide\b",
                    re.I)
LESSON = re.compile(r"\byou\s+will\b|\byou'll\s+be\s+able\s+to\b", re.I)
# A formula: TeX, or an expression with a Greek letter, a product sign, a fraction or an equals sign between terms.
FORMULA = re.compile(r"\$[^$]+\$|[ΨαβΣ√]|\w\s*[×·/]\s*\w|\w\s*=\s*[\w(]")
HEADLINE = re.compile(r"this\s+run's\s+(?:result|headline|answer)[^.]*\b(?:under|below)\b", re.I)
MAX_WORDS = 230  # a first screen: the title, one paragraph, a formula, the core path


def opening(cells: list[dict]) -> str:
    return "".join(next(c for c in cells if c["cell_type"] == "markdown")["source"])


def lesson_problems(text: str) -> list[str]:
    """What keeps a chapter's first Markdown cell from being its lesson (empty when it is one)."""
    found = []
    body = re.sub(r"^# .*\n", "", text.strip() + "\n", count=1)  # the title line
    if not LESSON.search(body):
        found.append("does not say what the learner will be able to do ('you will ...')")
    if not FORMULA.search(body):
        found.append("carries no formula")
    if not HEADLINE.search(body):
        found.append("does not say where this run's headline number shows (under the setup cell)")
    if not re.search(r"\bcore\s+path\b", body, re.I) or "optional" not in body.lower():
        found.append("does not name the core path and the optional sections")
    if SOURCE.search(body) or any(a in body for a in AUTHORS):
        found.append("names a source (title, author, quote or link): they go to 'Sources and setup' at the end")
    if len(body.split()) > MAX_WORDS:
        found.append(f"{len(body.split())} words: more than a first screen ({MAX_WORDS})")
    return found


# Chapter 05's opening before the chapters opened with their lessons: a mechanism, no "you will", no core path.
OLD_05 = """# 05 · Data parallelism: all-reduce by hand, and DDP

Data parallelism is the first way to use more than one device. The job runs as N processes, the **ranks** (numbered
0 … N − 1, usually one per device), that run the same script and form a **process group** of size N, the **world
size**. Every rank holds the **whole model**, reads a **different slice of the batch**, and, before the
optimizer step, **averages the gradients** over all ranks. The price: each step, every rank all-reduces the fp32
gradients, 4Ψ bytes for Ψ parameters, in buckets that overlap with backward.

The chapter builds it by hand, checks PyTorch's `DistributedDataParallel` (DDP) against one process, counts what it
sends, and works out from those bytes when it stops scaling on a GPU cluster. This run's result shows under the
setup cell once section 8.1 has counted it. Sections 9 (TensorFlow) and 10 (several machines) are optional.
"""
# An opening with its lesson, but the sources' title and quote on the first screen (chapter 01's, once).
QUOTED = """# 01 · Mixed precision in PyTorch

You will be able to predict what 16-bit autocast saves: activations to ½ + F/(2T) of fp32's, model states none
(16 B/param). The promise, as “大模型微调高级优化技术” (by 一颗普通的眼球, 2025) makes it: “通常可以减少约50%的显存使用量”.
This run's result shows under the setup cell. Core path: sections 1–5; section 6 is optional.
"""


def test_the_old_openings_are_refused():
    problems = lesson_problems(OLD_05)
    assert any("you will" in p for p in problems) and any("core path" in p for p in problems), problems
    assert any("names a source" in p for p in lesson_problems(QUOTED))


@pytest.mark.parametrize("notebook", all_notebooks(), ids=lambda p: p.stem[:2])
def test_the_first_screen_is_the_lesson(notebook):
    cells = json.loads(notebook.read_text())["cells"]
    problems = lesson_problems(opening(cells))
    assert not problems, f"{notebook.name}: " + "; ".join(problems)
    # the number the opening promises: displayed by the setup cell, filled in once the chapter has measured it
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    assert "display_id=True" in code[1] and "headline" in code[1], "the setup cell displays no headline"
    assert any("headline.update(" in c for c in code[2:]), "nothing fills the headline in"
    assert code[1].startswith("# "), "the setup cell opens with a one-line comment saying what it is"
    assert "hardware_report()" not in code[1], "the setup cell prints the hardware report: it goes to the end"
    # the sources are kept, at the end
    headings = [ln for c in cells if c["cell_type"] == "markdown" for ln in "".join(c["source"]).splitlines()
                if ln.startswith("## ")]
    assert "## Sources and setup" in headings, "no 'Sources and setup' section"
