"""The chapters' prose states no machine-dependent figure that the run beside it did not produce.

A sentence in a Markdown cell that quotes a time, a rate, a speed ratio, a measured share of time or memory, or
says what "a CPU" can or cannot do, is a figure from some machine. Where a paragraph interprets a measurement, its
numbers and its wording come from this run: printed by the code, or rendered from the ledger. A figure from
elsewhere (a GPU, a paper, a data sheet, a source article) appears in one labelled form, inside the sentence:
`(measured on <hardware>: <source>)` or `(<hardware> data sheet)`. The patterns below find the unlabelled ones;
the fixtures are sentences the chapters once held, each contradicted by a run on another CPU.

A sentence that compares times ("faster", "slower", a speed-up) says so only where the two spreads separate: the
chapters write it with `cl.timing.compare`, which puts both ranges inside the sentence, and `unsupported_comparisons`
reads them back. A comparison without its ranges, or with a word its ranges do not support, fails, in the Markdown
here and in every executed chapter's output (tests/test_notebooks.py).
"""
from __future__ import annotations

import json
import re

import pytest

from course_lib.paths import all_notebooks

_NUM = r"(?<![\w.])\d+(?:[.,]\d+)?(?:\s*[–-]\s*\d+(?:[.,]\d+)?)?"
PATTERNS = {
    "a time": re.compile(_NUM + r"\s*(?:ms|µs|us|ns|s|sec|seconds?|min|minutes?|hours?)\b(?!/)"),
    "a rate": re.compile(_NUM + r"\s*(?:[kMGTP]?FLOP/s|[kMGT]i?B/s|tokens?/s|tok/s|samples/s|it/s|steps?/s)"),
    "a speed ratio": re.compile(r"(?=.*\b(?:faster|slower|speed|speed-?ups?|time|throughput|rate)\b)"
                                r".*?" + _NUM + r"\s*(?:×|x\b)", re.I),
    "a measured figure": re.compile(r"\bmeasured\b[^;:]{0,60}?\b\d+\.\d+|\b\d+\.\d+\s+measured\b"),
    "a peak in GB": re.compile(r"\b(?:peak(?:ed|s)?|RSS)\b[^;]{0,40}?\b\d+(?:\.\d+)?\s*[GM]i?B\b"),
    "a share of the step": re.compile(_NUM + r"\s*%\s*(?:of (?:the )?(?:step|time|wall|runtime))"),
    "what a CPU can do": re.compile(r"\b(?:on|of) (?:a|any) CPU\b[^.]*\b(?:no|not|never|always|cannot)\b"),
}
LABEL = re.compile(r"\((?:measured on [^():]+:[^()]+|[^()]*\bdata sheet)\)")

# Sentences the chapters held, each contradicted by a run on another CPU (a 2-core AMD EPYC with AVX-512): the
# patterns must find every one.
CONTRADICTED = [
    "And in a model this small the casts and the many small ops weigh as much as the matmuls: on that same CPU the "
    "step ran at 0.5–0.75× fp32's speed.",
    "Either way: use 16-bit on a CPU to check correctness and memory, not to save time.",
    "on others they run at about fp32 speed (an AMD EPYC with AVX2 only, without oneDNN: 5.5 ms against fp32's "
    "6.5 ms a step).",
    "elsewhere it costs about the same (an AVX2 run here: 8.5 ms with XLA against 7.0 without, on steps this small):",
    "**Time.** The times above are recorded, not celebrated: on a CPU there are no 16-bit matrix units to use "
    "(fp16 runs only through XLA's upcast, bf16 through oneDNN where the CPU has it), so mixed precision buys no "
    "speed; seed 001's 2–3× comes from a V100's tensor cores.",
    "The count done with the stages' measured mean times predicts it within a few hundredths at small m, and less "
    "well at m = 8 (one run: 0.187 measured against 0.127 predicted, marked missed in the ledger):",
    "On 2 CPU cores at Qwen2.5-0.5B's shape they ran 1.41× `Trainer`'s target tokens per second; adding "
    "`--loss-chunk 1024` brought it down to 1.08×: the chunked loss recomputes the head's logits in backward, time "
    "spent for memory.",
    "With blocks of 1 MiB or more mapped on their own ZeRO-3 peaks at 6.6-6.75 GB and FSDP2 at 6.5 (7.7 and "
    "6.7-7.3 with a 16 MiB threshold or glibc's default): within the bound, ZeRO-3 by 0.2 GB.",
    "On a CPU with AMX or AVX512-BF16, bf16 matmuls are fast; on an AVX2-only CPU they are 10–33× slower.",
]
# What must pass: figures that are arithmetic, or labelled.
FINE = [
    "ZeRO-3 holds 16Ψ/N bytes per rank: 3.95 GB for Qwen2.5-0.5B on 2 ranks.",
    "The H100 runs bf16 matmuls at up to 989 TFLOP/s (H100 SXM data sheet).",
    "Tensor cores made the step 2.1× faster (measured on one H200: the course's GPU reference run).",
    "With p = 2 and m = 8 the formula gives 0.111 of the step.",
    "A 7B model's Adam moments take 8 bytes per parameter, 2× its fp32 weights.",
]


# How cl.timing.compare writes a spread, and the words of a comparison of times.
RANGE = re.compile(r"range (\d+(?:\.\d+)?(?:e[-+]?\d+)?)–(\d+(?:\.\d+)?(?:e[-+]?\d+)?)")
COMPARES = re.compile(r"\b(?:faster|slower|quicker|speed-?ups?|slowdowns?)\b|\bspeed\s*[×x]\s?\d", re.I)
# A comparison that is not this run's: a prediction, a GPU reference run or a data sheet (labelled), a claim asserted
# with a margin physics gives (its own line says what sets the margin), or the word used of something not measured.
NOT_A_RUN = re.compile(r"\bpredict|\bformula|\bexpected\b|\(measured on [^():]+:|data sheet|\bmargin\b|"
                       r"\bif\b|\bwould\b|\bcould\b|\bmay\b|\bneed not\b|\bnot necessarily\b", re.I)

# Sentences a chapter printed, each comparing times its own spread did not separate (chapter 11's old caveat first):
# `unsupported_comparisons` must refuse every one.
UNSUPPORTED = [
    "first to turn on here: zero2 (less memory, no slowdown measured against ddp)",
    "zero2 speed x1.21 vs ddp: inside the timing tolerance here; between GPUs and across nodes, measure it where you "
    "train",
    "bf16 autocast ran 1.14x faster than fp32 on this CPU.",
    "prefetch made the forward 0.585x as fast, slower than without it",
    "bf16 ran 1.14× faster than fp32 (bf16: median 10.2 ms, range 9.8–11.9; fp32: median 11.6 ms, range 11.0–12.1)",
    "bf16 and fp32 are indistinguishable here (bf16: median 10.2 ms, range 9.8–10.5; fp32: median 11.6 ms, range "
    "11.0–12.1)",
]
SUPPORTED = [
    "bf16 ran 1.14× faster than fp32 (bf16: median 10.2 ms, range 9.8–10.5; fp32: median 11.6 ms, range 11.0–12.1)",
    "fp32 ran 1.14× slower than bf16 (fp32: median 11.6 ms, range 11.0–12.1; bf16: median 10.2 ms, range 9.8–10.5)",
    "zero2 and ddp are indistinguishable here (zero2: median 210 ms, range 190–260; ddp: median 200 ms, range 185–230)",
    "Tensor cores made the step 2.1× faster (measured on one H200: the course's GPU reference run).",
    "The formula predicts the fused op 2× faster: it reads the tensor once instead of twice.",
]


# What ties a sentence of fixed Markdown to this run's times; a fixed sentence cannot carry this run's spread, so it
# may compare times in general (a mechanism, a GPU, a source's claim) but not say how this run's times came out,
# except by pointing at the verdict the code printed.
THIS_RUN = re.compile(r"\bhere\b|\bthis (?:run|machine|CPU)\b|\bmeasured\b|\bran\b|\babove\b|\bbelow\b", re.I)


def unsupported_comparisons(text: str, fixed: bool = False) -> list[str]:
    """The sentences of `text` that compare times without the spreads that support the word they use. `fixed`: text
    written in advance (a Markdown cell), where only sentences about this run's times count (THIS_RUN)."""
    if fixed:  # titles and quotes of the sources are theirs, not claims about this run
        text = re.sub(r"“[^”]*”|(?<![*\w])\*[^*]+?\*(?![*\w])", "…", text)
    found = []
    for s in sentences(text):
        if not COMPARES.search(s) and "indistinguishable" not in s:
            continue
        if NOT_A_RUN.search(s) or (fixed and (not THIS_RUN.search(s) or "verdict" in s)):
            continue
        ranges = [(float(a), float(b)) for a, b in RANGE.findall(s)]
        if len(ranges) != 2:
            if COMPARES.search(s):
                found.append(s)
            continue
        (a_lo, a_hi), (b_lo, b_hi) = ranges
        separate = a_hi < b_lo or b_hi < a_lo
        says = "indistinguishable" if "indistinguishable" in s else (
            "faster" if re.search(r"\bfaster\b", s) else "slower" if re.search(r"\bslower\b", s) else "")
        right = {"indistinguishable": not separate, "faster": a_hi < b_lo, "slower": a_lo > b_hi}.get(says, False)
        if not right:
            found.append(s)
    return found


def sentences(markdown: str) -> list[str]:
    """The sentences of a Markdown cell, code blocks and formulas left out (table rows and list items count as one)."""
    text = re.sub(r"```.*?```", " ", markdown, flags=re.S)
    text = re.sub(r"\$\$.*?\$\$|\$[^$\n]+\$", " ", text, flags=re.S)
    out = []
    for line_block in re.split(r"\n\s*\n|\n(?=\s*(?:[*-] |\d+\. |\|))", text):
        out += [s.strip() for s in re.split(r"(?<=[.!?])\s+(?=[A-Z*(`])", " ".join(line_block.split())) if s.strip()]
    return out


def machine_figures(sentence: str) -> list[str]:
    """What in one sentence reads as a figure from some machine (empty when it carries a label)."""
    if LABEL.search(sentence):
        return []
    return [kind for kind, pattern in PATTERNS.items() if pattern.search(sentence)]


@pytest.mark.parametrize("sentence", CONTRADICTED)
def test_the_patterns_find_each_contradicted_sentence(sentence):
    assert machine_figures(sentence), sentence


@pytest.mark.parametrize("sentence", FINE)
def test_arithmetic_and_labelled_figures_pass(sentence):
    assert not machine_figures(sentence), machine_figures(sentence)


@pytest.mark.parametrize("sentence", UNSUPPORTED)
def test_a_comparison_its_spread_does_not_support_is_refused(sentence):
    assert unsupported_comparisons(sentence), sentence


@pytest.mark.parametrize("sentence", SUPPORTED)
def test_a_comparison_with_separate_spreads_passes(sentence):
    assert not unsupported_comparisons(sentence), sentence


def test_compare_writes_what_the_check_reads():
    from course_lib.timing import Spread, compare

    fast, slow, wide = Spread([0.0098, 0.0102, 0.0105]), Spread([0.0110, 0.0116, 0.0121]), Spread([0.009, 0.013])
    assert "faster" in compare(fast, slow, "bf16", "fp32") and not unsupported_comparisons(compare(fast, slow, "a", "b"))
    assert "slower" in compare(slow, fast, "fp32", "bf16") and not unsupported_comparisons(compare(slow, fast, "a", "b"))
    said = compare(wide, slow, "bf16", "fp32")
    assert "indistinguishable here" in said and not unsupported_comparisons(said)
    # ranges apart by less than the printed digits (chapter 08 once printed "range 1336–1482" beside "1153–1336")
    for k in (1, 0.01, 0.001):
        slow, fast = Spread([1.3362 * k, 1.482 * k]), Spread([1.153 * k, 1.3357 * k])
        said = compare(slow, fast, "1F1B", "GPipe")
        assert "slower" in said and not unsupported_comparisons(said), said
        said = compare(fast, slow, "GPipe", "1F1B")
        assert "faster" in said and not unsupported_comparisons(said), said


@pytest.mark.parametrize("notebook", all_notebooks(), ids=lambda p: p.stem[:2])
def test_markdown_compares_no_times_without_their_spread(notebook):
    cells = json.loads(notebook.read_text())["cells"]
    found = [f"[{i}] {s}" for i, c in enumerate(cells) if c["cell_type"] == "markdown"
             for s in unsupported_comparisons("".join(c["source"]), fixed=True)]
    assert not found, "\n".join(found)


def output_text(executed) -> list[tuple[int, str]]:
    """(cell, text) of what an executed notebook printed or displayed as text or Markdown, the ledger's tables left
    out (their rows are claims and observations, each with its own expectation)."""
    out = []
    for i, cell in enumerate(json.loads(executed.read_text())["cells"]):
        for o in cell.get("outputs", []):
            if o["output_type"] == "stream":
                out.append((i, "".join(o["text"])))
            elif o["output_type"] in ("display_data", "execute_result"):
                data = o.get("data", {})
                if "claims held" in "".join(data.get("text/html", "")):
                    continue
                out.append((i, "".join(data.get("text/markdown", data.get("text/plain", "")))))
    return out


def unsupported_in_outputs(executed) -> list[str]:
    """What an executed chapter printed that compares times its spreads do not support (tests/test_notebooks.py)."""
    return [f"[{i}] {s}" for i, text in output_text(executed) for line in text.splitlines()
            for s in unsupported_comparisons(line)]  # a printed line is a unit: print() ends its sentences there


@pytest.mark.parametrize("notebook", all_notebooks(), ids=lambda p: p.stem[:2])
def test_prose_quotes_no_figure_from_another_machine(notebook):
    cells = json.loads(notebook.read_text())["cells"]
    found = [f"[{i}] {kinds}: {s}" for i, c in enumerate(cells) if c["cell_type"] == "markdown"
             for s in sentences("".join(c["source"])) if (kinds := machine_figures(s))]
    assert not found, "\n".join(found)
