"""Exercises with checked answers, and "predict, then run" (every chapter).

A chapter's exercises come after its last measurement. They open with one line:

    ex = cl.exercises.Exercises(ledger, solutions=solutions)   # `solutions` is set in the parameters cell

The learner's cell names its exercise on the first line and assigns a variable of the same name, `...` until
the learner replaces it:

    # Exercise zero3_14b: ZeRO-3 model states per GPU for Qwen2.5-14B on 16 GPUs, in GiB
    zero3_14b = ...

and the cell after it checks the answer, never with a traceback:

    ex.check("zero3_14b")     # "correct", "not yet" with a hint, or "skipped" while it is still `...`

The reference solutions are kept apart from the notebooks, in `course_lib/solutions/NN.py`: one block per
exercise (`# %% name`, optional `# hint:` and `# rel:` / `# atol:` lines, then code that assigns the answer).
The expected answer is the reference's, computed on a copy of the notebook's variables, so it follows the
machine and the profile. With `solutions=True` (the test suite's run) the reference also fills the learner's
cell before it runs, and an answer that does not check out fails the notebook. Each check lands in the ledger
as `exercise_<name>`: ok (correct), failed (not yet) or skipped.

Predict, then run: before a chapter's main measurement the learner writes down a guess (`predicted = ...`);
after it `cl.exercises.compare(predicted, measured, ...)` shows the two side by side (and records both).
"""
from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

SOLUTIONS = Path(__file__).resolve().parent / "solutions"
_HEADER = re.compile(r"^# Exercise (\w+)\b")
_BLOCK = re.compile(r"^# %% (\w+)\s*$", re.M)


@dataclass
class Reference:
    """One exercise's reference solution: code that assigns the answer to a variable named like the exercise."""
    name: str
    code: str
    hint: str = ""
    rel: float = 1e-6
    atol: float = 0.0


def load_references(chapter: str) -> dict[str, Reference]:
    """The reference solutions of a chapter ("06" or "06_zero_deepspeed"), by exercise name."""
    path = SOLUTIONS / f"{chapter[:2]}.py"
    text = path.read_text()
    parts = _BLOCK.split(text)
    refs = {}
    for name, body in zip(parts[1::2], parts[2::2]):
        ref, code = Reference(name, ""), []
        for line in body.strip("\n").splitlines():
            meta = re.match(r"^# (hint|rel|atol): (.*)$", line)
            if meta and not code:
                key, value = meta.groups()
                setattr(ref, key, value if key == "hint" else float(value))
            else:
                code.append(line)
        ref.code = "\n".join(code).strip() + "\n"
        refs[name] = ref
    return refs


def same(answer, expected, rel: float = 1e-6, atol: float = 0.0) -> bool:
    """Whether an answer matches: numbers within rel/atol, strings ignoring case and spaces at the ends,
    lists/tuples/dicts element by element, anything else by ==."""
    if isinstance(expected, bool) or isinstance(answer, bool):
        return answer is expected or answer == expected
    if isinstance(expected, (int, float)) and isinstance(answer, (int, float)):
        if math.isnan(answer) or math.isnan(expected):
            return False
        return abs(answer - expected) <= max(rel * abs(expected), atol)
    if getattr(answer, "ndim", None) == 0 and hasattr(answer, "item"):  # a numpy scalar or a 0-d tensor
        return same(answer.item(), expected, rel, atol)
    if isinstance(expected, str) and isinstance(answer, str):
        return answer.strip().lower() == expected.strip().lower()
    if isinstance(expected, dict) and isinstance(answer, dict):
        return answer.keys() == expected.keys() and all(same(answer[k], expected[k], rel, atol) for k in expected)
    if isinstance(expected, (list, tuple)) and isinstance(answer, (list, tuple)):
        return len(answer) == len(expected) and all(same(a, e, rel, atol) for a, e in zip(answer, expected))
    return answer == expected


class Exercises:
    """A chapter's exercises: `check(name)` after each learner cell. See the module docstring."""

    def __init__(self, ledger, solutions: bool = False, chapter: str | None = None):
        self.ledger, self.solutions = ledger, bool(solutions)
        self.references = load_references(chapter or ledger.data["notebook"])
        self.outcomes: dict[str, str] = {}
        if self.solutions:
            _fill_learner_cells(self.references)

    def check(self, name: str) -> None:
        """Say whether the learner's `name` is right: "correct", "not yet" (with a hint) or "skipped" (still `...`,
        or never run). Prints one line and records `exercise_<name>` in the ledger (`.outcomes` keeps the word)."""
        ref = self.references[name]
        namespace = _notebook_namespace()
        answer = namespace.get(name, ...)
        if answer is ...:
            status, line = "skipped", f"exercise {name}: skipped (replace the `...` in its cell, run it, then this one)"
        else:
            try:
                expected = _run_reference(ref, namespace)
                ok = same(answer, expected, ref.rel, ref.atol)
                problem = "" if ok else f"your answer: {_short(answer)}"
            except Exception as e:  # the reference cannot run here, or the answer cannot be compared
                ok, problem = False, f"could not check it ({type(e).__name__}: {e})"
            status = "correct" if ok else "not yet"
            line = f"exercise {name}: correct" if ok else \
                f"exercise {name}: not yet. {problem}" + (f"\n  hint: {ref.hint}" if ref.hint else "")
        self.outcomes[name] = status
        self.ledger.verdict(f"exercise_{name}", status, {"correct": True, "not yet": False}.get(status),
                            note="reference solution filled in" if self.solutions else "")
        print(line)
        if self.solutions and status != "correct":  # the test suite: every reference must check out
            raise AssertionError(f"exercise {name}: the reference solution did not check out ({line})")

    def summary(self) -> None:
        """One line: how many of the chapter's exercises are correct, not yet, skipped."""
        counts = {s: list(self.outcomes.values()).count(s) for s in ("correct", "not yet", "skipped")}
        missing = [n for n in self.references if n not in self.outcomes]
        text = ", ".join(f"{v} {k}" for k, v in counts.items()) + (f", {len(missing)} not checked" if missing else "")
        print(f"exercises: {text}")


def compare(predicted, measured, unit: str = "", name: str | None = None, ledger=None, note: str = "") -> None:
    """Predict, then run: show the learner's prediction beside the measurement (and record both)."""
    def shown(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    if predicted is ...:
        print(f"measured: {shown(measured)} {unit}   (you made no prediction: write one above, then run both cells)")
    else:
        off = ""
        if isinstance(predicted, (int, float)) and isinstance(measured, (int, float)) and measured:
            off = f"; off by {abs(predicted - measured) / abs(measured):.0%}"
        print(f"you predicted {shown(predicted)} {unit}; measured {shown(measured)} {unit}{off}")
    if ledger is not None and name:
        ledger.record(f"measured_{name}", measured, unit, note=note)
        if predicted is not ...:
            ledger.record(f"predicted_{name}", predicted, unit, note="the learner's guess before the run")


def _short(value) -> str:
    text = f"{value:.6g}" if isinstance(value, float) else repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _notebook_namespace() -> dict:
    """The variables of the notebook (IPython's user namespace), or the caller's module globals outside it."""
    try:
        from IPython import get_ipython

        shell = get_ipython()
        if shell is not None:
            return shell.user_ns
    except ImportError:
        pass
    return sys.modules["__main__"].__dict__


def _run_reference(ref: Reference, namespace: dict):
    """The reference's answer, computed on a shallow copy of the notebook's variables (nothing leaks back)."""
    scratch = dict(namespace)
    exec(compile(ref.code, f"<reference solution {ref.name}>", "exec"), scratch)
    return scratch[ref.name]


def _fill_learner_cells(references: dict[str, Reference]) -> None:
    """solutions=True: a cell whose first line is `# Exercise <name>` runs the reference solution instead."""
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        return

    def fill(lines: list[str]) -> list[str]:
        match = _HEADER.match(lines[0]) if lines else None
        if not match or match.group(1) not in references:
            return lines
        code = references[match.group(1)].code
        return [lines[0], "# (reference solution, filled in because solutions = True)\n",
                *code.splitlines(keepends=True)]

    shell.input_transformers_post[:] = [t for t in shell.input_transformers_post
                                        if getattr(t, "__name__", "") != "fill"] + [fill]
