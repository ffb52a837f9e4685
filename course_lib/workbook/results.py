"""The results ledger: every figure a chapter measures, with what theory expects and whether it held.

A chapter opens one ledger and records into it; the file `build/results/<notebook>.json` is
rewritten after every record, so a notebook that fails half-way still leaves what it measured.
Every row has a kind, and the kind says what a reader may conclude from it:

    ledger = cl.Ledger("00_where_does_the_memory_go", profile=P.name)
    ledger.check("adam_bytes", measured, "B", expect=16 * n, rel=0)    # a claim: asserted, fails the notebook if off
    ledger.observe("comm_seconds", t, "s", predict=alpha_beta_sum)     # an observation: shown beside its prediction
    ledger.record("step_time", 0.42, "s")                              # a record: a figure, no expectation
    ledger.skip("section 6, TensorFlow", "TensorFlow is not installed")  # not measured here, and why

What may be a claim (README, "How the chapters check themselves"): arithmetic, bytes, equality and exact
resume, asserted tight; speed, shares of time and overlap only with a margin that holds on any CPU a learner
may have (the note says what sets it). Anything else that has a prediction is an observation: the ratio of
measured to predicted is kept beside it, and it is never red. `check` raises AssertionError when a claim misses;
with COURSE_RECORD_ONLY=1 in the environment (`make run RECORD=1`: a first run on new hardware, where one run
should return every figure) a missed claim is kept as `recorded` instead, and the notebook goes on. In Jupyter
the checks are not printed one line each: they are collected and shown as one table per section of the notebook
(the code cells between two headings), after its last cell; `ledger.show()` shows the rows collected so far at
once. Elsewhere (a script, pytest) each check prints its line. Introduced in chapter 00.
"""
from __future__ import annotations

import html
import json
import math
import os
import re
from pathlib import Path

from ..paths import REPO_ROOT, build_dir  # noqa: F401  (re-exported: notebooks and tests import them from here)

RECORD_ONLY = "COURSE_RECORD_ONLY"  # "1": a claim that misses is recorded (status "recorded"), not raised


def record_only() -> bool:
    """Whether claims are recorded instead of asserted in this process (COURSE_RECORD_ONLY=1)."""
    return os.environ.get(RECORD_ONLY, "") not in ("", "0")


def _describe(expect, rel, abs_tol) -> str | None:
    if expect is None:
        return None
    if isinstance(expect, tuple):
        lo, hi = expect
        return f"[{'-inf' if lo is None else f'{lo:g}'}, {'inf' if hi is None else f'{hi:g}'}]"
    if isinstance(expect, bool):
        return str(expect)
    tol = []
    if rel:
        tol.append(f"±{rel:.3g} rel")
    if abs_tol:
        tol.append(f"±{abs_tol:g}")
    shown = f"{expect:,}" if isinstance(expect, int) else f"{expect:g}"
    return shown + (f" ({', '.join(tol)})" if tol else " (exact)")


def meets(value, expect, rel: float = 0.0, abs_tol: float = 0.0) -> bool:
    """Whether `value` meets `expect`: a number (within rel/abs tolerance), a (lo, hi) range, or a bool."""
    if isinstance(expect, tuple):
        lo, hi = expect
        return (lo is None or value >= lo) and (hi is None or value <= hi)
    if isinstance(expect, bool):
        return bool(value) == expect
    if isinstance(value, float) and math.isnan(value):
        return False
    return abs(value - expect) <= max(rel * abs(expect), abs_tol)


def _mark(ok: bool | None) -> str:
    """ok / FAIL for a claim (MISS when claims are only recorded), "seen" for an observation."""
    return {True: "ok  ", False: "MISS" if record_only() else "FAIL", None: "seen"}[ok]


def _fmt_number(x) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def claim_outcomes(metrics: dict) -> list[bool]:
    """Held or not, for each claim among a ledger's metrics (observations, records and exercises are not claims;
    a ledger written before rows had kinds counts every row with a verdict as a claim)."""
    return [m["ok"] for m in metrics.values() if m.get("ok") is not None and m.get("kind", "claim") == "claim"]


def failed_claims(metrics: dict) -> dict:
    """The rows of a ledger's metrics that are claims which did not hold (recorded ones included)."""
    return {k: m for k, m in metrics.items() if m.get("ok") is False and m.get("kind", "claim") == "claim"}


class Ledger:
    """The figures of one notebook run; see the module docstring."""

    def __init__(self, notebook: str, profile: str, device: str | None = None, quiet: bool = False):
        """`quiet`: rows are written to the file only, never shown; for a ledger a library function fills inside a
        chapter's kernel (the benchmark's), which must not take over the chapter's own section tables."""
        from ..env import pick_device

        self.path = build_dir() / "results" / f"{notebook}.json"
        self.data = {"notebook": notebook, "profile": profile, "device": device or str(pick_device()), "metrics": {}}
        self._save()
        self._quiet = quiet
        self._tables = None if quiet else _SectionTables.start(notebook)  # None outside Jupyter: rows print a line

    def _store(self, name: str, value, unit: str, kind: str, expect=None, rel: float = 0.0, atol: float = 0.0,
               note: str = "") -> dict:
        if hasattr(value, "item"):  # a 0-d tensor or numpy scalar
            value = value.item()
        entry = {"value": value, "unit": unit, "kind": kind, "expect": _describe(expect, rel, atol), "ok": None}
        if note:
            entry["note"] = note
        self.data["metrics"][name] = entry
        return entry

    def record(self, name: str, value, unit: str = "", note: str = "") -> None:
        """Store a figure: no expectation, no verdict."""
        self._store(name, value, unit, "record", note=note)
        self._save()

    def observe(self, name: str, value, unit: str = "", predict=None, note: str = "", spread=None) -> None:
        """Store a figure beside what a model predicts for it, and their ratio: an observation, never asserted and
        never counted as a claim that failed. For what the machine decides (time on shared cores, a framework's
        overheads) where no margin holds on every CPU; the chapter explains the gap. `spread`: the
        `cl.timing.Spread` (or its samples) the figure is the median of, kept in the row (median, min, max, n) and
        shown beside it."""
        if spread is not None:
            from ..timing import spread as as_spread

            spread = as_spread(spread)
            note = (note + "; " if note else "") + f"range {spread.lo:.4g}–{spread.hi:.4g} over {len(spread.samples)} runs"
        entry = self._store(name, value, unit, "observation", note=note)
        entry.pop("expect")
        if spread is not None:
            entry["spread"] = spread.as_dict()
        entry["predicted"] = predict
        if isinstance(predict, (int, float)) and not isinstance(predict, bool) and predict and entry["value"] is not None:
            entry["ratio"] = entry["value"] / predict
        self._save()
        self._show_row(None, name, value, unit, "predicted " + _fmt_number(predict) + (
            f" (measured/predicted {entry['ratio']:.2f})" if "ratio" in entry else ""), note)

    def check(self, name: str, value, unit: str = "", expect=None, rel: float = 0.0, atol: float = 0.0,
              note: str = "") -> None:
        """Record a claim and assert it (under COURSE_RECORD_ONLY=1, a miss is kept as `recorded`, not raised).
        Shows the figure either way. Returns nothing, so a cell that ends with a check shows no stray `Out[]`."""
        if expect is None:
            raise ValueError(f"check({name!r}) needs an expectation; use record() for a bare figure")
        entry = self._store(name, value, unit, "claim", expect, rel, atol, note)
        ok = entry["ok"] = meets(entry["value"], expect, rel, atol)
        if not ok and record_only():
            entry["status"] = "recorded"
        self._save()
        shown = f"{value:.6g}" if isinstance(value, float) else f"{value}"
        self._show_row(bool(ok), name, shown, unit, "expected " + str(entry["expect"]), note)
        if not ok and not record_only():
            raise AssertionError(f"{name} = {shown} {unit}, expected {entry['expect']}" + (f": {note}" if note else ""))

    def _show_row(self, ok: bool | None, name: str, shown, unit: str, against: str, note: str) -> None:
        """A claim (ok True/False) or an observation (ok None): one line, or a row of the section's table."""
        if self._quiet:
            return
        if not isinstance(shown, str):
            shown = _fmt_number(shown)
        if self._tables is None:
            print(f"{_mark(ok)} {name} = {shown} {unit}  ({against})")
        else:
            self._tables.add((ok, name, shown, unit, against, note))

    def skip(self, name: str, reason: str) -> None:
        """Mark a figure, or a whole section, as not measured here (status `skipped`, not failed), saying why."""
        self.data["metrics"][name] = {"value": None, "unit": "", "kind": "record", "expect": None, "ok": None,
                                      "status": "skipped", "note": reason}
        self._save()

    @property
    def device(self) -> str:
        return self.data["device"]

    @device.setter
    def device(self, name: str) -> None:
        """The device the figures come from, when it is known only later (chapter 02: TensorFlow's view)."""
        self.data["device"] = name
        self._save()

    def verdict(self, name: str, value, ok: bool | None, note: str = "") -> None:
        """Record an outcome decided elsewhere, not a claim about this machine (an exercise's answer, checked by
        course_lib.workbook.exercises): ok True or False, or None for skipped (status `skipped`: neither held nor failed)."""
        entry = {"value": value, "unit": "", "kind": "exercise", "expect": None, "ok": ok, "note": note}
        if ok is None:
            entry["status"] = "skipped"
        self.data["metrics"][name] = entry
        self._save()

    def show(self) -> None:
        """Show the checks collected since the last table now, as one table (Jupyter); elsewhere nothing to do."""
        if self._tables is not None:
            self._tables.show()

    def __getitem__(self, name: str):
        return self.data["metrics"][name]["value"]

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=float))
        tmp.replace(self.path)


class _SectionTables:
    """In a Jupyter kernel: the ledger's checks, collected and shown as one table at the end of each section.

    A section is the run of code cells between two markdown headings of the chapter's notebook
    (notebooks/<name>.ipynb, read once); a cell is recognized by its source. A cell not found there (edited,
    or papermill's injected parameters) ends its section itself; so does a cell that fails, so the failing
    check shows beside the ones before it."""

    _active = None  # the callback of the ledger opened last: re-running the setup cell replaces it

    def __init__(self, shell, last_cells: dict):
        self.shell, self.last_cells, self.rows = shell, last_cells, []

    @classmethod
    def start(cls, notebook: str):
        try:
            from IPython import get_ipython
        except ImportError:
            return None
        shell = get_ipython()
        if shell is None or not hasattr(shell, "events"):
            return None
        if cls._active is not None:
            cls._active.shell.events.unregister("post_run_cell", cls._active._after_cell)
        cls._active = cls(shell, _last_cells_of_sections(REPO_ROOT / "notebooks" / f"{notebook}.ipynb"))
        shell.events.register("post_run_cell", cls._active._after_cell)
        return cls._active

    def add(self, row: tuple) -> None:
        self.rows.append(row)

    def _after_cell(self, result) -> None:
        if self.rows and (self.last_cells.get(_norm(result.info.raw_cell), True) or not result.success):
            self.show()

    def show(self) -> None:
        if self.rows:
            from IPython.display import display

            display(_ChecksTable(self.rows))
            self.rows = []


def _norm(source: str) -> str:
    return "\n".join(line.rstrip() for line in source.strip().splitlines())


def _last_cells_of_sections(path: Path) -> dict:
    """{code cell source: whether it is the last code cell before the next heading} of a notebook file."""
    try:
        cells = json.loads(path.read_text())["cells"]
    except (OSError, ValueError, KeyError):
        return {}
    out, previous = {}, None
    for cell in cells:
        source = "".join(cell.get("source", ""))
        if cell.get("cell_type") == "code":
            previous = _norm(source)
            out[previous] = False
        elif previous is not None and re.search(r"^#{1,6} ", source, re.M):
            out[previous] = True
    if previous is not None:
        out[previous] = True
    return out


class _ChecksTable:
    """The rich display of a section's rows: an HTML table in Jupyter, aligned text elsewhere. A row is a claim
    (ok True / False: held, or failed; MISS when claims are only recorded) or an observation (ok None: shown
    beside its prediction, in grey, never red)."""

    _COLOR = {True: "#176917", False: "#b00020", None: "#555"}

    def __init__(self, rows: list[tuple]):
        self.rows = rows

    def __repr__(self) -> str:
        width = max(len(r[1]) for r in self.rows)
        return "\n".join(f"{_mark(ok)} {name:{width}s}  {shown} {unit}  ({against})"
                         for ok, name, shown, unit, against, _ in self.rows)

    def _repr_html_(self) -> str:
        cells = "".join(
            f"<tr><td style='color:{self._COLOR[ok]}'>{_mark(ok).strip()}</td>"
            f"<td style='text-align:left'><code>{html.escape(name)}</code></td>"
            f"<td style='text-align:right'>{html.escape(shown)} {html.escape(unit)}</td>"
            f"<td style='text-align:left'>{html.escape(str(against))}</td>"
            f"<td style='text-align:left;color:#555'>{html.escape(note)}</td></tr>"
            for ok, name, shown, unit, against, note in self.rows)
        claims = [r[0] for r in self.rows if r[0] is not None]
        seen = len(self.rows) - len(claims)
        head = f"ledger: {sum(claims)} of {len(claims)} claims held" + (f", {seen} observed" if seen else "")
        return (f"<details open><summary>{head}</summary><table>"
                "<tr><th></th><th>row</th><th>measured</th><th>against</th><th>note</th></tr>"
                f"{cells}</table></details>")


def load_all(results_dir: Path | None = None) -> list[dict]:
    """Every ledger under build/results, sorted by notebook name (used by the report)."""
    results_dir = results_dir or build_dir() / "results"
    return [json.loads(p.read_text()) for p in sorted(results_dir.glob("*.json"))]


def save_figure(fig, name: str) -> Path:
    """Save a matplotlib figure as build/figures/<name>.png (name starts with the chapter number),
    so the report shows it beside the chapter's ledger."""
    path = build_dir() / "figures" / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def label_points(ax, points: dict, fontsize: int = 8) -> None:
    """Name each point of a scatter plot (`points`: name -> (x, y) in data coordinates) with its label on the side
    where it lands farthest from the other points and the labels already placed, inside the axes, joined to its point
    by a thin line where it sits apart: neighbours' names never land on each other's markers. Call it after the axes'
    limits and scales are set (it places labels in screen space)."""
    ax.figure.canvas.draw()  # the limits and scales as they will be drawn
    px = ax.figure.dpi / 72  # pixels a point
    screen = {n: ax.transData.transform(xy) for n, xy in points.items()}
    box = ax.get_window_extent()
    offsets = [(8, 6), (8, -12), (-8, 6), (-8, -12), (0, 12), (0, -16), (14, -3), (-14, -3),
               (18, 14), (18, -20), (-18, 14), (-18, -20)]
    placed = []
    for name in sorted(points, key=lambda n: -screen[n][1]):
        x, y = screen[name]
        others = [p for n, p in screen.items() if n != name] + placed
        width = 0.6 * fontsize * len(name) * px  # about a character's width in this font size

        def score(off):  # the label's centre to the nearest other marker or label (labels are wide); outside: worst
            left = x + off[0] * px - (width if off[0] < 0 else width / 2 if off[0] == 0 else 0)
            bottom = y + off[1] * px - fontsize * px / 2
            if left < box.x0 or left + width > box.x1 or bottom < box.y0 or bottom + fontsize * px > box.y1:
                return -1.0
            cx, cy = left + width / 2, bottom + fontsize * px / 2
            return min((((cx - ox) / 3) ** 2 + (cy - oy) ** 2) ** 0.5 for ox, oy in others) if others else 1e9

        best = max(offsets, key=score)  # (first of equals: the nearest sides come first)
        placed.append((x + best[0] * px, y + best[1] * px))
        far = abs(best[0]) > 10 or abs(best[1]) > 14
        ax.annotate(name, points[name], textcoords="offset points", xytext=best, fontsize=fontsize,
                    ha="left" if best[0] > 0 else "right" if best[0] < 0 else "center", va="center",
                    arrowprops=dict(arrowstyle="-", lw=0.5, color="0.4") if far else None)
