"""The results ledger: every figure a chapter measures, with what theory expects and whether it held.

A chapter opens one ledger and records into it; the file `build/results/<notebook>.json` is
rewritten after every record, so a notebook that fails half-way still leaves what it measured:

    ledger = cl.Ledger("00_where_does_the_memory_go", profile=P.name)
    ledger.record("step_time", 0.42, "s")                              # a figure, no claim
    ledger.check("adam_bytes", measured, "B", expect=16 * n, rel=0)    # a claim: fails if off
    ledger.skip("section 6, TensorFlow", "TensorFlow is not installed")  # not measured here, and why

`check` raises AssertionError when the figure misses its expectation: a claim that does not hold
fails the notebook, and the runner (course_lib.runner) reports it. `skip` marks what a chapter could not
measure on this machine (status `skipped`, not failed; course_lib.optional uses it). In Jupyter the checks are
not printed one line each: they are collected and shown as one table per section of the notebook (the code cells
between two headings), after its last cell; `ledger.show()` shows the checks collected so far at once. Elsewhere
(a script, pytest) each check prints its line. Introduced in chapter 00.
"""
from __future__ import annotations

import html
import json
import math
import re
from pathlib import Path

from .paths import REPO_ROOT, build_dir  # noqa: F401  (re-exported: notebooks and tests import them from here)


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


class Ledger:
    """The figures of one notebook run; see the module docstring."""

    def __init__(self, notebook: str, profile: str, device: str | None = None):
        from .env import pick_device

        self.path = build_dir() / "results" / f"{notebook}.json"
        self.data = {"notebook": notebook, "profile": profile, "device": device or str(pick_device()), "metrics": {}}
        self._save()
        self._tables = _SectionTables.start(notebook)  # None outside Jupyter: check() prints its line

    def record(self, name: str, value, unit: str = "", expect=None, rel: float = 0.0, atol: float = 0.0, note: str = "") -> bool | None:
        """Store a figure; with `expect`, also whether it meets it (returned, never raised)."""
        if hasattr(value, "item"):  # a 0-d tensor or numpy scalar
            value = value.item()
        ok = None if expect is None else meets(value, expect, rel, atol)
        entry = {"value": value, "unit": unit, "expect": _describe(expect, rel, atol), "ok": ok}
        if note:
            entry["note"] = note
        self.data["metrics"][name] = entry
        self._save()
        return ok

    def check(self, name: str, value, unit: str = "", expect=None, rel: float = 0.0, atol: float = 0.0, note: str = ""):
        """Record a claim and assert it. Prints the figure either way; returns the value."""
        if expect is None:
            raise ValueError(f"check({name!r}) needs an expectation; use record() for a bare figure")
        ok = self.record(name, value, unit, expect, rel, atol, note)
        entry = self.data["metrics"][name]
        shown = f"{value:.6g}" if isinstance(value, float) else f"{value}"
        if self._tables is None:
            print(f"{'ok  ' if ok else 'FAIL'} {name} = {shown} {unit}  (expected {entry['expect']})")
        else:
            self._tables.add((bool(ok), name, shown, unit, entry["expect"], note))
        assert ok, f"{name} = {shown} {unit}, expected {entry['expect']}" + (f": {note}" if note else "")
        return value

    def skip(self, name: str, reason: str) -> None:
        """Mark a figure, or a whole section, as not measured here (status `skipped`, not failed), saying why."""
        self.data["metrics"][name] = {"value": None, "unit": "", "expect": None, "ok": None, "status": "skipped",
                                      "note": reason}
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
        course_lib.exercises): ok True or False, or None for skipped (status `skipped`: neither held nor failed)."""
        entry = {"value": value, "unit": "", "expect": None, "ok": ok, "note": note}
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
    """The rich display of a section's checks: an HTML table in Jupyter, aligned text elsewhere."""

    def __init__(self, rows: list[tuple]):
        self.rows = rows

    def __repr__(self) -> str:
        width = max(len(r[1]) for r in self.rows)
        return "\n".join(f"{'ok  ' if ok else 'FAIL'} {name:{width}s}  {shown} {unit}  (expected {expect})"
                         for ok, name, shown, unit, expect, _ in self.rows)

    def _repr_html_(self) -> str:
        cells = "".join(
            f"<tr><td style='color:{'#176917' if ok else '#b00020'}'>{'ok' if ok else 'FAIL'}</td>"
            f"<td style='text-align:left'><code>{html.escape(name)}</code></td>"
            f"<td style='text-align:right'>{html.escape(shown)} {html.escape(unit)}</td>"
            f"<td style='text-align:left'>{html.escape(str(expect))}</td>"
            f"<td style='text-align:left;color:#555'>{html.escape(note)}</td></tr>"
            for ok, name, shown, unit, expect, note in self.rows)
        held = sum(r[0] for r in self.rows)
        return (f"<details open><summary>ledger: {held} of {len(self.rows)} checks held</summary><table>"
                "<tr><th></th><th>claim</th><th>measured</th><th>expected</th><th>note</th></tr>"
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
