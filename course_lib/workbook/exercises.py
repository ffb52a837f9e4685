"""Exercises with checked answers, and "predict, then run" (every chapter).

A chapter's exercises come after its last measurement. They open with one line:

    ex = cl.exercises.Exercises(ledger, solutions=solutions)   # `solutions` is set in the parameters cell

The learner's cell names its exercise on the first line and assigns a variable of the same name, `...` until
the learner replaces it:

    # Exercise zero3_14b: ZeRO-3 model states per GPU for Qwen2.5-14B on 16 GPUs, in GiB
    zero3_14b = ...

and the cell after it checks the answer, never with a traceback:

    ex.check("zero3_14b")     # "correct", "not yet" with a hint, or "skipped" while it is still `...`

The reference solutions are kept apart from the notebooks, in `course_lib/workbook/solutions/NN.py`: one block per
exercise (`# %% name`, then lines that say how to check it, then code that assigns the answer; the format is in
`solutions/README.md`). The expected answer is the reference's, computed on a copy of the notebook's variables, so
it follows the machine and the profile.

How an answer is compared (`same`): anything number-like (int, float, a numpy scalar or array, a 0-d or 1-d
tensor, a list) by value. A count (the reference gives an int) must be exact. Any other number is accepted within
half a unit of its third significant figure, or of the last digit the chapter prints where that is coarser
(`# printed: 0.001`): 13.8 for 13.76 is right. A choice (a string) is compared ignoring case, spaces and
punctuation, and a block may list other spellings of it (`# alias:`). A block lists the likely mistakes
(`# mistake: <expression> :: <hint>`, evaluated like the reference): an answer that matches one gets that
mistake's own hint. Where a mistake lies inside the band of a rounded answer (1/65504 beside 2**-16), only the
exact value counts, and a rounded one is asked for in an exact form (`# exact:`).

With `solutions=True` (the test suite's run) the reference also fills the learner's cell before it runs, and an
answer that does not check out fails the notebook. Each check lands in the ledger as `exercise_<name>`: ok
(correct), failed (not yet) or skipped.

Predict, then run: before a chapter's main measurement the learner writes down a guess (`predicted = ...`);
after it `cl.exercises.compare(predicted, measured, ...)` shows the two side by side (and records both).
"""
from __future__ import annotations

import math
import numbers
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

SOLUTIONS = Path(__file__).resolve().parent / "solutions"
_HEADER = re.compile(r"^# Exercise (\w+)\b")
_BLOCK = re.compile(r"^# %% (\w+)\s*$", re.M)
_META = re.compile(r"^# (hint|rel|atol|printed|digits|exact|alias|mistake|build): (.*)$")
SIGNIFICANT = 3  # an answer rounded to this many significant figures is right


@dataclass
class Mistake:
    """A likely wrong answer: an expression evaluated after the reference (it may use the reference's names)."""
    expression: str
    hint: str


@dataclass
class Reference:
    """One exercise's reference solution: code that assigns the answer to a variable named like the exercise,
    and how to compare an answer with it (see the module docstring)."""
    name: str
    code: str
    hint: str = ""
    rel: float = 0.0        # an extra relative tolerance (the band is the widest of rel, atol, printed, digits)
    atol: float = 0.0
    printed: float = 0.0    # the unit of the last digit the chapter prints for this number (0: none)
    digits: int = SIGNIFICANT
    exact: str = ""         # how to give it exactly, where a mistake lies inside the rounded band
    aliases: dict = field(default_factory=dict)   # canonical spelling -> other accepted spellings
    mistakes: list = field(default_factory=list)  # [Mistake]
    build: bool = False     # the answer is code, run against the real thing (course_lib/workbook/builds.py)

    def tolerance(self) -> dict:
        return {"rel": self.rel, "atol": self.atol, "printed": self.printed, "digits": self.digits}


def load_references(chapter: str) -> dict[str, Reference]:
    """The reference solutions of a chapter ("06" or "06_zero_deepspeed"), by exercise name."""
    path = SOLUTIONS / f"{chapter[:2]}.py"
    text = path.read_text()
    parts = _BLOCK.split(text)
    refs = {}
    for name, body in zip(parts[1::2], parts[2::2]):
        ref, code = Reference(name, ""), []
        for line in body.strip("\n").splitlines():
            meta = _META.match(line)
            if meta and not code:
                key, value = meta.groups()
                if key == "build":
                    ref.build = value.strip().lower() == "yes"
                elif key in ("hint", "exact"):
                    setattr(ref, key, value.strip())
                elif key == "digits":
                    ref.digits = int(value)
                elif key == "alias":
                    canonical, _, others = value.partition(" = ")
                    ref.aliases.setdefault(canonical.strip(), []).extend(o.strip() for o in others.split("|"))
                elif key == "mistake":
                    expression, _, hint = value.partition(" :: ")
                    ref.mistakes.append(Mistake(expression.strip(), hint.strip()))
                else:
                    setattr(ref, key, float(value))
            else:
                code.append(line)
        ref.code = "\n".join(code).strip() + "\n"
        refs[name] = ref
    return refs


def plain(value):
    """A number-like value as plain Python: numpy scalars and arrays, tensors (any device, with or without
    gradients) and tuples become numbers and lists; dicts keep their keys."""
    if value is None or value is ... or isinstance(value, (bool, str)):
        return value
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu()
    if hasattr(value, "tolist") and not isinstance(value, (int, float)):  # numpy scalars and arrays, tensors
        return plain(value.tolist())
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def band(expected: float, rel: float = 0.0, atol: float = 0.0, printed: float = 0.0, digits: int = SIGNIFICANT) -> float:
    """How far an answer may be from `expected`: half a unit of its `digits`-th significant figure, or of the
    last digit the chapter prints (`printed`), whichever is wider (and rel/atol where given)."""
    size = abs(expected)
    sig = 0.5 * 10.0 ** (math.floor(math.log10(size)) - digits + 1) if size and math.isfinite(size) else 0.0
    return max(sig, printed / 2, rel * size, atol) * (1 + 1e-9) + 1e-15 * size


def _words(text: str) -> str:
    return re.sub(r"[^0-9a-z.+]", "", text.lower())


def same(answer, expected, rel: float = 0.0, atol: float = 0.0, printed: float = 0.0, digits: int = SIGNIFICANT,
         aliases: dict | None = None, cap: float | None = None) -> bool:
    """Whether an answer matches the expected one (see the module docstring): counts exactly, other numbers within
    `band`, strings ignoring case, spaces and punctuation (and in any spelling of `aliases`), lists, tuples and
    dicts element by element. `cap`: the widest a number's band may be (where a mistake lies inside it)."""
    answer, expected = plain(answer), plain(expected)
    tol = dict(rel=rel, atol=atol, printed=printed, digits=digits, aliases=aliases, cap=cap)
    if isinstance(expected, bool) or isinstance(answer, bool):
        return isinstance(answer, (bool, int)) and isinstance(expected, (bool, int)) and answer == expected
    if isinstance(expected, (int, float)) and isinstance(answer, (int, float)):
        if math.isnan(answer) or math.isnan(expected):
            return False
        if isinstance(expected, int) and not (rel or atol or printed):  # a count
            return answer == expected
        width = band(expected, rel, atol, printed, digits)
        return abs(answer - expected) <= (width if cap is None else min(width, cap))
    if isinstance(expected, str) and isinstance(answer, str):
        spelled = {_words(expected)}
        for canonical, others in (aliases or {}).items():
            if _words(canonical) == _words(expected):
                spelled |= {_words(o) for o in others}
        return _words(answer) in spelled
    if isinstance(expected, dict) and isinstance(answer, dict):
        keys = {(_words(k) if isinstance(k, str) else k): k for k in answer}
        want = {(_words(k) if isinstance(k, str) else k): k for k in expected}
        return keys.keys() == want.keys() and all(same(answer[keys[k]], expected[want[k]], **tol) for k in want)
    if isinstance(expected, list) and isinstance(answer, list):
        return len(answer) == len(expected) and all(same(a, e, **tol) for a, e in zip(answer, expected))
    if isinstance(expected, (int, float)) and isinstance(answer, list) and len(answer) == 1:  # a 1-element tensor
        return same(answer[0], expected, **tol)
    return answer == expected


def verdict(ref: Reference, answer, namespace: dict) -> tuple[str, str]:
    """("correct" or "not yet", the line's explanation) for `answer` against the reference run on `namespace`."""
    expected, scratch = _run_reference(ref, namespace, keep=True)
    tol = {**ref.tolerance(), "aliases": ref.aliases}
    mistakes, names = [], {"math": math, **scratch}
    for m in ref.mistakes:
        try:
            value = plain(eval(compile(m.expression, f"<mistake of {ref.name}>", "eval"), names))
        except Exception:  # a mistake this notebook's state cannot express: no hint for it here
            continue
        mistakes.append((value, m.hint))
    # a mistake inside the band of the expected number: only answers nearer the expected one than the mistake count
    cap = None
    if isinstance(plain(expected), (int, float)) and not isinstance(plain(expected), bool):
        close = [abs(v - plain(expected)) / 2 for v, _ in mistakes if isinstance(v, (int, float))
                 and not isinstance(v, bool) and v != plain(expected) and same(v, expected, **tol)]
        cap = min(close) if close else None
    if same(answer, expected, **tol, cap=cap):
        return "correct", ""
    for value, hint in mistakes:
        inside = cap is not None and isinstance(value, (int, float)) and same(value, expected, **tol)
        if same(answer, value, **tol, cap=abs(value - plain(expected)) / 2 if inside else None):
            return "not yet", f"your answer: {_short(answer)}\n  hint: {hint}"
    if cap is not None and same(answer, expected, **tol):
        return "not yet", (f"your answer: {_short(answer)} is close, but so is a common wrong answer: give it exactly"
                           + (f" ({ref.exact})" if ref.exact else ""))
    return "not yet", f"your answer: {_short(answer)}" + (f"\n  hint: {ref.hint}" if ref.hint else "")


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
        elif ref.build:
            status, problem = _build_verdict(ref, self.solutions)
            line = f"exercise {name}: correct" if status == "correct" else f"exercise {name}: not yet. {problem}"
        else:
            try:
                status, problem = verdict(ref, answer, namespace)
            except Exception as e:  # the reference cannot run here, or the answer cannot be compared
                status, problem = "not yet", f"could not check it ({type(e).__name__}: {e})"
            line = f"exercise {name}: correct" if status == "correct" else f"exercise {name}: not yet. {problem}"
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
    predicted, measured = plain(predicted), plain(measured)

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


def _build_verdict(ref: Reference, solutions: bool) -> tuple[str, str]:
    """A build exercise: the learner's cell (the reference's code under solutions=True) run by its check."""
    from . import builds

    source = ref.code if solutions else builds.cell_source(ref.name)
    if source is None:
        return "not yet", f"no cell starting `# Exercise {ref.name}` has run in this notebook"
    message = builds.run({ref.name: {"yours": source}})[ref.name]["yours"]
    if message is None:
        return "correct", ""
    return "not yet", message + (f"\n  hint: {ref.hint}" if ref.hint else "")


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


def _run_reference(ref: Reference, namespace: dict, keep: bool = False):
    """The reference's answer, computed on a shallow copy of the notebook's variables (nothing leaks back);
    `keep`: also the copy, where the reference's own names are (the mistakes' expressions use them)."""
    scratch = dict(namespace)
    exec(compile(ref.code, f"<reference solution {ref.name}>", "exec"), scratch)
    return (scratch[ref.name], scratch) if keep else scratch[ref.name]


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
