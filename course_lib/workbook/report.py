"""`build/report.html`: every chapter's status and time, every ledger figure with its expectation.

Written by the runner after each run (course_lib.workbook.runner); figures that chapters save with
`cl.save_figure` (build/figures/*.png) are shown from their files, each with its title as alt text
(`figure_titles`), so the page stays light. The front page is what a
reader opens instead of the logs: the totals, every claim that failed, the capstone's table, ranking and
plots (chapter 11, from build/capstone/summary.json), then one table row per chapter (notebooks never run
included) linking to its page in the book (course_lib.workbook.book), the ledgers that belong to no chapter (the
speed benchmark's) in a table of their own, then each chapter's ledger: every metric
with its expectation, `ok` and note, and a column per committed reference run (results/<label>/, e.g. a
GPU's figures). The same page is the book's front page, build/book/index.html.
"""
from __future__ import annotations

import html
import json
import os
import re
from pathlib import Path

from .. import paths
from ..paths import all_notebooks, reference_dirs
from .results import claim_outcomes, failed_claims, load_all

_STYLE = """body{font-family:system-ui,sans-serif;margin:2em;max-width:70em}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left}
th{background:#f3f3f3}.ok{color:#176917}.failed,.bad{color:#b00020;font-weight:bold}.none{color:#777}
tr:target{background:#fff6c9}
img{max-width:100%;border:1px solid #ddd;margin:.5em 0}code{background:#f6f6f6}
.summary{font-size:1.1em}.note{color:#555;font-size:.9em}td.num{text-align:right}"""


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return html.escape(json.dumps(value) if isinstance(value, (list, dict)) else str(value))


def _ok_cell(m: dict) -> str:
    """ok / FAIL for a claim (recorded: a claim that missed while claims were only recorded); an observation shows
    measured/predicted; a figure without a claim shows its status if it has one (e.g. "skipped")."""
    ok = m.get("ok")
    if m.get("kind") == "observation":
        ratio = f" ×{m['ratio']:.2g}" if isinstance(m.get("ratio"), (int, float)) else ""
        return f'<td class="none">observed{ratio}</td>'
    if ok is None:
        return f'<td class="none">{html.escape(str(m.get("status", "-")))}</td>'
    if not ok and m.get("status") == "recorded":
        return '<td class="bad">recorded, not held</td>'
    return '<td class="ok">ok</td>' if ok else '<td class="bad">FAIL</td>'


def _expected(m: dict) -> str:
    """A claim's expectation, or an observation's prediction ("≈ 0.013 predicted")."""
    if m.get("kind") == "observation":
        p = m.get("predicted")
        return "" if p is None else f"≈ {_fmt(p)} predicted"
    return html.escape(m.get("expect") or "")


_METRIC_FIELDS = {"value", "unit", "expect", "ok", "note", "status", "kind", "predicted", "ratio"}


def _note(m: dict) -> str:
    """The note, then any field this report does not know (newer ledgers may add some)."""
    extra = [f"{k}: {_fmt(v)}" for k, v in m.items() if k not in _METRIC_FIELDS]
    return "; ".join([html.escape(m.get("note", ""))] * bool(m.get("note")) + extra)


def row_id(notebook: str, metric: str) -> str:
    """The id of a ledger row on the front page (chapter pages in the book link to it)."""
    return "m-" + notebook + "-" + "".join(c if c.isalnum() or c in "-_." else "_" for c in metric)


def _claims(ledger: dict) -> list[bool]:
    return claim_outcomes(ledger.get("metrics", {}))


def references() -> dict[str, dict]:
    """Committed reference runs (course_lib.paths.reference_dirs): label -> {dir, runs, ledgers}."""
    out = {}
    for label, folder in reference_dirs().items():
        runs = json.loads((folder / "runs.json").read_text()) if (folder / "runs.json").exists() else {}
        ledgers = {d["notebook"]: d for d in load_all(folder / "results")} if (folder / "results").is_dir() else {}
        out[label] = {"dir": folder, "runs": runs, "ledgers": ledgers}
    return out


def _code_cells(path: Path) -> dict:
    """{cell id: source} of a notebook's code cells, papermill's injected parameters aside."""
    cells = json.loads(path.read_text()).get("cells", [])
    return {c.get("id"): "".join(c["source"]) for c in cells if c["cell_type"] == "code"
            and "injected-parameters" not in c.get("metadata", {}).get("tags", [])}


def stale_note(ref: dict, name: str) -> str:
    """Why a reference run's chapter `name` is not this chapter as it is now: "" when its executed notebook ran the
    code cells the chapter has now (or there is none to compare); else one line, with the commit it ran (its
    runs.json entry's `commit`, which tools/gpu_run.py writes) and how many of the chapter's code cells have changed
    since, matched by cell id. Its figures are then a record of that run, not of this code."""
    executed, current = ref["dir"] / "executed" / f"{name}.ipynb", Path(paths.NOTEBOOKS) / f"{name}.ipynb"
    if not executed.exists() or not current.exists():
        return ""
    ran, now = _code_cells(executed), _code_cells(current)
    changed = sum(ran.get(cid) != source for cid, source in now.items())
    if not changed:
        return ""
    commit = ref.get("runs", {}).get(name, {}).get("commit")
    return (f"stale: ran {'commit ' + commit if commit else 'an earlier version'}; {changed} of the chapter's "
            f"{len(now)} code cells have changed since")


def _ref_cell(m: dict | None) -> str:
    """A reference run's figure in one cell: value, unit and ✓ / ✗ (or its status, e.g. skipped)."""
    if not m or m.get("value") is None:
        return f"<td class='none'>{html.escape(str(m.get('status', '-')))}</td>" if m else "<td class='none'>-</td>"
    if m.get("ok") is not None:
        mark = " ✓" if m["ok"] else " ✗"
    else:
        mark = f" ({html.escape(str(m['status']))})" if m.get("status") else ""
    return f"<td class='num'>{_fmt(m['value'])} {html.escape(m.get('unit', ''))}{mark}</td>"


def ledger_table(name: str, ledger: dict, refs: dict, link: str | None = None) -> str:
    """One chapter's ledger: metric, value, unit, expectation, ok, note, then one column per reference run.
    Rows carry ids (row_id); with `link` (a page), each metric name links to its row there instead."""
    ref_metrics = {label: r["ledgers"].get(name, {}).get("metrics", {}) for label, r in refs.items()}
    ref_metrics = {label: ms for label, ms in ref_metrics.items() if ms}
    metrics = dict(ledger.get("metrics", {}))
    for ms in ref_metrics.values():  # figures only a reference run recorded still get a row
        metrics.update({k: {} for k in ms if k not in metrics})
    out = ["<table><tr><th>metric</th><th>value</th><th>unit</th><th>expected</th><th></th><th>note</th>"
           + "".join(f"<th>{html.escape(label)}</th>" for label in ref_metrics) + "</tr>"]
    for metric, m in metrics.items():
        rid = row_id(name, metric)
        shown = f"<a href='{link}#{rid}'>{html.escape(metric)}</a>" if link else html.escape(metric)
        value = "-" if m.get("value") is None else _fmt(m["value"])  # none: not measured (e.g. skipped)
        row = (f"<tr id='{rid}'><td>{shown}</td><td class='num'>{value}</td><td>{html.escape(m.get('unit', ''))}</td>"
               f"<td>{_expected(m)}</td>{_ok_cell(m)}<td class='note'>{_note(m)}</td>")
        out.append(row + "".join(_ref_cell(ms.get(metric)) for ms in ref_metrics.values()) + "</tr>")
    return "\n".join(out + ["</table>"])


_TITLE = re.compile(r"""(?:set_title|suptitle)\(\s*f?(["'])(.*?)(?<!\\)\1""")
_SAVED = re.compile(r"""save_figure\(\s*\w+\s*,\s*f?(["'])(.*?)\1""")


def cell_titles(source: str) -> list[str]:
    """The titles a code cell gives its figures (`set_title` / `suptitle`, an f-string's fields as "…")."""
    titles = [re.sub(r"\{[^{}]*\}", "…", m[2]).replace("\\n", " ").strip(" ;,:") for m in _TITLE.finditer(source)]
    return [t for t in titles if re.sub(r"[\s…:;,.]", "", t)]  # a title that is all fields says nothing


def figure_alt(source: str, fallback: str) -> str:
    """Alt text for the figure a cell draws: its titles, else the name it is saved under, else `fallback`."""
    titles = cell_titles(source)
    if titles:
        return "; ".join(dict.fromkeys(titles))
    saved = _SAVED.search(source)
    return f"figure {saved[2]}" if saved else fallback


def figure_titles(notebooks=None) -> dict[str, str]:
    """{saved figure name: alt text} from the chapters' cells that call `save_figure`."""
    out = {}
    for path in all_notebooks() if notebooks is None else notebooks:
        try:
            cells = json.loads(Path(path).read_text()).get("cells", [])
        except (OSError, ValueError):
            continue
        for cell in cells:
            source = "".join(cell.get("source", ""))
            for m in _SAVED.finditer(source):
                out[m[2]] = figure_alt(source, m[2])
    return out


def _img(png: Path, page_dir: Path, titles: dict) -> str:
    """A saved figure, from its file (a link relative to the page's folder), its title as alt text."""
    alt = titles.get(png.stem, f"figure {png.stem}")
    src = Path(os.path.relpath(png, page_dir)).as_posix()
    return f"<p><img alt='{html.escape(alt, quote=True)}' src='{html.escape(src, quote=True)}' loading='lazy'></p>"


def is_chapter(name: str) -> bool:
    """A chapter's name starts with its two-digit number (NN_name); other ledgers (the speed benchmark's) do not."""
    return re.match(r"\d\d_", name) is not None


def status_of(run: dict | None, ledger: dict | None) -> str:
    """ok / failed (or any other status) from the runner; "no run record" when only a ledger exists."""
    if run:
        return str(run.get("status", "-"))
    return "no run record" if ledger else "not run"


def _summary(names: list[str], runs: dict, ledgers: dict) -> str:
    """One line: chapters ok / failed / not run (and any other status), claims held (every ledger's), total time."""
    claims = [ok for n in names for ok in _claims(ledgers.get(n, {}))]
    names = [n for n in names if is_chapter(n)]  # a benchmark's ledger is not a chapter
    status = [status_of(runs.get(n), ledgers.get(n)) for n in names]
    seconds = sum(runs.get(n, {}).get("seconds", 0) for n in names)
    failed = status.count("failed")
    others = "".join(f", {status.count(s)} {html.escape(s)}" for s in sorted(set(status) - {"ok", "failed", "not run"}))
    return (f"<p class='summary'>{len(names)} chapters: <span class='ok'>{status.count('ok')} ok</span>, "
            f"<span class='{'failed' if failed else 'none'}'>{failed} failed</span>, {status.count('not run')} not run"
            + others.replace("no run record", "with a ledger but no run record") + "; "
            f"claims held: <b>{sum(claims)} / {len(claims)}</b>; {seconds / 60:.1f} min of execution.</p>")


def _failed_claims(names: list[str], ledgers: dict) -> str:
    """The claims that did not hold; then, apart, those that missed while claims were only recorded
    (COURSE_RECORD_ONLY). Observations are never listed: they have predictions, not expectations."""
    out = []
    for recorded, title in ((False, "Claims that did not hold"),
                            (True, "Claims recorded, not held (claims were only recorded in this run)")):
        bad = [(n, k, m) for n in names for k, m in failed_claims(ledgers.get(n, {}).get("metrics", {})).items()
               if (m.get("status") == "recorded") == recorded]
        if not bad:
            continue
        out += [f"<h2>{title}</h2>", "<table><tr><th>chapter</th><th>metric</th><th>value</th>"
                "<th>expected</th><th>note</th></tr>"]
        for n, k, m in bad:
            out.append(f"<tr><td><a href='#{n}'>{n}</a></td><td><a href='#{row_id(n, k)}'>{html.escape(k)}</a></td>"
                       f"<td>{_fmt(m.get('value'))} {html.escape(m.get('unit', ''))}</td><td>{_expected(m)}</td>"
                       f"<td class='note'>{_note(m)}</td></tr>")
        out.append("</table>")
    return "\n".join(out)


def _in_unit(nbytes: float, unit: str, table_unit: str) -> str:
    """Bytes in `unit` (GiB or MiB), the unit written out when it is not the table's (one GPU's CPU-rank rows)."""
    return f"{nbytes / (2**30 if unit == 'GiB' else 2**20):.2f}" + ("" if unit == table_unit else f" {unit}")


def _capstone(build: Path, page_dir: Path, titles: dict) -> str:
    """Chapter 11's table, ranking, comparison with the source articles' tables and plots (build/capstone/summary.json)."""
    from ..sft.capstone import read_summary

    cap = read_summary(build / "capstone" / "summary.json")
    if cap is None:
        return ""
    unit = cap["unit"]
    out = ["<h2>Capstone: what to turn on first, measured here</h2>",
           f"<p>{html.escape(cap['device'])} ({html.escape(str(cap.get('cpu', '')))}, native bf16: "
           f"{cap.get('bf16_native')}), profile <code>{cap['profile']}</code>, Ψ = {cap['params']:,} parameters, "
           f"{cap['ranks']} ranks, rows after fp32/bf16 in <b>{cap['base']}</b>. Budget: "
           f"{html.escape(cap['budget_note'])}. Details: <a href='#11_capstone_methodology'>chapter 11</a>.</p>",
           f"<table><tr><th>configuration</th><th>precision</th><th>ranks</th><th>model states ({unit})</th>"
           f"<th>of which host</th><th>saved activations</th><th>16-bit weight copies</th><th>device per rank</th>"
           f"<th>tokens/s</th><th>fit</th></tr>"]
    for r in cap["rows"]:
        tps = f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "-"
        out.append(f"<tr><td>{html.escape(r['label'])}</td><td>{r.get('precision') or '-'}</td><td class='num'>{r['ranks']}</td>"
                   + "".join(f"<td class='num'>{_in_unit(r.get(k, 0), r.get('unit', unit), unit)}</td>"
                             for k in ("states", "host", "saved", "copies", "device"))
                   + f"<td class='num'>{tps}</td><td class='{'ok' if r['fit'] else 'bad'}'>{'yes' if r['fit'] else 'no'}</td></tr>")
    out.append("</table><h3>The ranking that falls out of it</h3><ol>")
    for r in cap["ranking"]:
        then = "then, as a combination: " if r.get("combination") else ""
        out.append(f"<li>{then}<b>{html.escape(r['config'])}</b> ({r['kind']}): memory ×{r['memory']:.2f}; "
                   + (html.escape(r["comparison"]) if r.get("comparison") else  # a summary written before verdicts
                      f"speed ×{r['speed']:.2f} against {html.escape(r['ref'])}") + "</li>")
    out.append(f"</ol><p>Fastest configuration that fits, one process: <b>{html.escape(str(cap.get('fastest_that_fits')))}</b></p>")
    if cap.get("compare"):
        out.append("<h3>Beside the source articles' tables (after / before ratios)</h3><table><tr><th>ratio</th><th>source</th>"
                   "<th>theirs</th><th>ours</th></tr>")
        for c in cap["compare"]:
            out.append(f"<tr><td>{html.escape(c['what'])}</td><td>{html.escape(c['source'])}</td>"
                       f"<td class='num'>{_fmt(c['theirs'])}</td><td class='num'>{_fmt(c['ours'])}</td></tr>")
        out.append("</table>")
    out += [_img(png, page_dir, titles) for png in sorted((build / "figures").glob("11_*.png"))]
    return "\n".join(out)


def load(build: Path) -> tuple[dict, dict, list[str]]:
    """(runs, ledgers, chapter names) of a build folder: runs.json, results/*.json and every notebook."""
    runs_path = build / "runs.json"
    runs = json.loads(runs_path.read_text()) if runs_path.exists() else {}
    ledgers = {d["notebook"]: d for d in load_all(build / "results")}
    return runs, ledgers, sorted(set(runs) | set(ledgers) | {p.stem for p in all_notebooks()})


def render(build: Path, book: str, refs: dict | None = None) -> str:
    """The front page; `book` is the way from the page to build/book/ ("book/" or "" for the book's index).
    A chapter links to its page and a reference run's page where those have been written."""
    runs, ledgers, names = load(build)
    chapters, others = [n for n in names if is_chapter(n)], [n for n in names if not is_chapter(n)]
    refs = references() if refs is None else refs
    page_dir, titles = (build if book else build / "book"), figure_titles()
    page = lambda name, label="": f"{book}{label + '/' if label else ''}{name}.html"  # noqa: E731
    exists = lambda name, label="": (build / "book" / (label or ".") / f"{name}.html").exists()  # noqa: E731
    intro = (f"<p>Read the chapters with their outputs in the book: <a href='{book}index.html'>{book}index.html</a>"
             "</p>" if book and (build / "book" / "index.html").exists() else "")
    out = [f"<!doctype html><meta charset='utf-8'><title>Workbook report</title><style>{_STYLE}</style>",
           "<h1 id='top'>Workbook report</h1>", intro, _summary(names, runs, ledgers), _failed_claims(names, ledgers),
           _capstone(build, page_dir, titles), "<h2>Chapters</h2>",
           "<table id='contents'><tr><th>chapter</th><th>profile</th><th>status</th><th>time (s)</th><th>claims ok</th><th>ledger</th>"
           + "".join(f"<th>{html.escape(label)}</th>" for label in refs) + "</tr>"]
    for name in chapters:
        run, ledger = runs.get(name, {}), ledgers.get(name, {})
        claims, status = _claims(ledger), status_of(run, ledger)
        held = f"{sum(claims)} / {len(claims)}" if claims else "-"
        title = f"<a href='{page(name)}'>{name}</a>" if exists(name) else name
        row = (f"<tr><td>{title}</td><td>{run.get('profile', ledger.get('profile', '-'))}</td>"
               f"<td class='{status if status in ('ok', 'failed') else 'none'}'>{html.escape(status)}</td>"
               f"<td class='num'>{run.get('seconds', 0):.1f}</td><td class='{'bad' if False in claims else ''}'>{held}</td>"
               f"<td><a href='#{name}'>ledger</a></td>")
        for label, r in refs.items():
            shown = html.escape(status_of(r["runs"].get(name), r["ledgers"].get(name))
                                + (", stale" if stale_note(r, name) else ""))
            row += f"<td><a href='{page(name, label)}'>{shown}</a></td>" if exists(name, label) else f"<td class='none'>{shown}</td>"
        out.append(row + "</tr>")
    out.append("</table>")
    if others:  # ledgers no chapter wrote (the speed benchmark, cl.bench): pages of their own, outside the chapters
        out += ["<h2>Other ledgers</h2>", "<table id='others'><tr><th>ledger</th><th>claims ok</th><th>figures</th></tr>"]
        for name in others:
            claims = _claims(ledgers.get(name, {}))
            title = f"<a href='{page(name)}'>{name}</a>" if exists(name) else name
            out.append(f"<tr><td>{title}</td><td>{f'{sum(claims)} / {len(claims)}' if claims else '-'}</td>"
                       f"<td class='num'>{len(ledgers.get(name, {}).get('metrics', {}))}</td></tr>")
        out.append("</table>")
    for name in names:
        run, ledger = runs.get(name, {}), ledgers.get(name, {})
        out.append(f"<h2 id='{name}'>{name}</h2>")
        if exists(name):
            out.append(f"<p><a href='{page(name)}'>Read the chapter with its outputs</a></p>")
        if run.get("error"):
            out.append(f"<pre class='failed'>{html.escape(run['error'])}</pre>")
        if run.get("parameters"):
            out.append(f"<p>parameters set: <code>{html.escape(', '.join(f'{k}={v!r}' for k, v in run['parameters'].items()))}</code></p>")
        if ledger:
            out.append(f"<p>device <code>{html.escape(str(ledger.get('device')))}</code>, profile "
                       f"<code>{html.escape(str(ledger.get('profile')))}</code></p>")
        if ledger or any(r["ledgers"].get(name) for r in refs.values()):
            out.append(ledger_table(name, ledger, refs))
        elif not run:
            out.append("<p class='none'>not run yet</p>")
        if name.startswith("11_") and (build / "capstone" / "summary.json").exists():
            out.append("<p>Its table and plots are on the front page (<a href='#top'>top</a>).</p>")
            continue
        if is_chapter(name):
            out += [_img(png, page_dir, titles) for png in sorted((build / "figures").glob(f"{name[:2]}_*.png"))]
    return "\n".join(out)


def write_report(build: Path, refs: dict | None = None) -> Path:
    """build/report.html (its chapters link into build/book/ where the book has been written)."""
    path = build / "report.html"
    build.mkdir(parents=True, exist_ok=True)
    path.write_text(render(build, "book/", refs))
    return path
