"""`build/report.html`: every chapter's status and time, every ledger figure with its expectation.

Written by the runner after each run (course_lib.runner); figures that chapters save with
`cl.save_figure` (build/figures/*.png) are embedded, so the page stands alone. The front page is what a
reader opens instead of the logs: the totals, every claim that failed, the capstone's table, ranking and
plots (chapter 11, from build/capstone/summary.json), then one table row per chapter (notebooks never run
included), then each chapter's ledger: every metric with its expectation, `ok` and note.
"""
from __future__ import annotations

import base64
import html
import json
from pathlib import Path

from .results import load_all

_STYLE = """body{font-family:system-ui,sans-serif;margin:2em;max-width:70em}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left}
th{background:#f3f3f3}.ok{color:#176917}.failed,.bad{color:#b00020;font-weight:bold}.none{color:#777}
img{max-width:100%;border:1px solid #ddd;margin:.5em 0}code{background:#f6f6f6}
.summary{font-size:1.1em}.note{color:#555;font-size:.9em}td.num{text-align:right}"""


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return html.escape(json.dumps(value) if isinstance(value, (list, dict)) else str(value))


def _ok_cell(ok, status=None) -> str:
    if status == "skipped":
        return '<td class="none">skipped</td>'
    if ok is None:
        return '<td class="none">-</td>'
    return '<td class="ok">ok</td>' if ok else '<td class="bad">FAIL</td>'


def _img(png: Path) -> str:
    data = base64.b64encode(png.read_bytes()).decode()
    return f"<p><img alt='{png.stem}' src='data:image/png;base64,{data}'></p>"


def _status(run: dict | None, ledger: dict | None) -> str:
    """ok / failed from the runner; "no run record" when only a ledger exists (run outside the runner)."""
    if run:
        return run.get("status", "-")
    return "no run record" if ledger else "not run"


def _summary(names: list[str], runs: dict, ledgers: dict) -> str:
    """One line: chapters ok / failed / not run, claims held, total time."""
    status = [_status(runs.get(n), ledgers.get(n)) for n in names]
    claims = [m["ok"] for n in names for m in ledgers.get(n, {}).get("metrics", {}).values() if m["ok"] is not None]
    seconds = sum(runs.get(n, {}).get("seconds", 0) for n in names)
    failed = status.count("failed")
    return (f"<p class='summary'>{len(names)} chapters: <span class='ok'>{status.count('ok')} ok</span>, "
            f"<span class='{'failed' if failed else 'none'}'>{failed} failed</span>, {status.count('not run')} not run"
            + (f", {status.count('no run record')} with a ledger but no run record" if "no run record" in status else "")
            + "; "
            f"claims held: <b>{sum(claims)} / {len(claims)}</b>; {seconds / 60:.1f} min of execution.</p>")


def _failed_claims(names: list[str], ledgers: dict) -> str:
    bad = [(n, k, m) for n in names for k, m in ledgers.get(n, {}).get("metrics", {}).items() if m["ok"] is False]
    if not bad:
        return ""
    out = ["<h2>Claims that did not hold</h2>", "<table><tr><th>chapter</th><th>metric</th><th>value</th>"
           "<th>expected</th><th>note</th></tr>"]
    for n, k, m in bad:
        out.append(f"<tr><td><a href='#{n}'>{n}</a></td><td>{html.escape(k)}</td><td>{_fmt(m['value'])} "
                   f"{html.escape(m['unit'])}</td><td>{html.escape(m['expect'] or '')}</td>"
                   f"<td class='note'>{html.escape(m.get('note', ''))}</td></tr>")
    return "\n".join(out + ["</table>"])


def _capstone(build: Path) -> str:
    """Chapter 11's table, ranking, comparison with the seeds and plots (build/capstone/summary.json)."""
    from .capstone import read_summary

    cap = read_summary(build / "capstone" / "summary.json")
    if cap is None:
        return ""
    unit = cap["unit"]
    scale = 2**30 if unit == "GiB" else 2**20
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
                   + "".join(f"<td class='num'>{r.get(k, 0) / scale:.2f}</td>"
                             for k in ("states", "host", "saved", "copies", "device"))
                   + f"<td class='num'>{tps}</td><td class='{'ok' if r['fit'] else 'bad'}'>{'yes' if r['fit'] else 'no'}</td></tr>")
    out.append("</table><h3>The ranking that falls out of it</h3><ol>")
    for r in cap["ranking"]:
        then = "then, as a combination: " if r.get("combination") else ""
        out.append(f"<li>{then}<b>{html.escape(r['config'])}</b> ({r['kind']}): memory ×{r['memory']:.2f}, "
                   f"speed ×{r['speed']:.2f} against {html.escape(r['ref'])}</li>")
    out.append(f"</ol><p>Fastest configuration that fits: <b>{html.escape(str(cap.get('fastest_that_fits')))}</b></p>")
    if cap.get("compare"):
        out.append("<h3>Beside the seeds (after / before ratios)</h3><table><tr><th>ratio</th><th>seed</th>"
                   "<th>theirs</th><th>ours</th></tr>")
        for c in cap["compare"]:
            out.append(f"<tr><td>{html.escape(c['what'])}</td><td>{html.escape(c['seed'])}</td>"
                       f"<td class='num'>{_fmt(c['theirs'])}</td><td class='num'>{_fmt(c['ours'])}</td></tr>")
        out.append("</table>")
    out += [_img(png) for png in sorted((build / "figures").glob("11_*.png"))]
    return "\n".join(out)


def write_report(build: Path) -> Path:
    from .runner import all_notebooks  # here, not at the top: the runner imports this module

    runs_path = build / "runs.json"
    runs = json.loads(runs_path.read_text()) if runs_path.exists() else {}
    ledgers = {d["notebook"]: d for d in load_all(build / "results")}
    names = sorted(set(runs) | set(ledgers) | {p.stem for p in all_notebooks()})
    out = [f"<!doctype html><meta charset='utf-8'><title>Workbook report</title><style>{_STYLE}</style>",
           "<h1 id='top'>Workbook report</h1>", _summary(names, runs, ledgers), _failed_claims(names, ledgers),
           _capstone(build), "<h2>Chapters</h2>",
           "<table><tr><th>notebook</th><th>profile</th><th>status</th><th>time (s)</th><th>claims ok</th></tr>"]
    for name in names:
        run, ledger = runs.get(name, {}), ledgers.get(name, {})
        claims = [m["ok"] for m in ledger.get("metrics", {}).values() if m["ok"] is not None]
        status = _status(run, ledger)
        held = f"{sum(claims)} / {len(claims)}" if claims else "-"
        out.append(f"<tr><td><a href='#{name}'>{name}</a></td><td>{run.get('profile', ledger.get('profile', '-'))}</td>"
                   f"<td class='{status if status in ('ok', 'failed') else 'none'}'>{status}</td>"
                   f"<td class='num'>{run.get('seconds', 0):.1f}</td><td class='{'bad' if False in claims else ''}'>{held}</td></tr>")
    out.append("</table>")
    for name in names:
        run, ledger = runs.get(name, {}), ledgers.get(name, {})
        out.append(f"<h2 id='{name}'>{name}</h2>")
        if run.get("error"):
            out.append(f"<pre class='failed'>{html.escape(run['error'])}</pre>")
        if ledger:
            out.append(f"<p>device <code>{html.escape(ledger['device'])}</code>, profile <code>{ledger['profile']}</code></p>")
            out.append("<table><tr><th>metric</th><th>value</th><th>unit</th><th>expected</th><th></th><th>note</th></tr>")
            for metric, m in ledger["metrics"].items():
                out.append(f"<tr><td>{html.escape(metric)}</td><td>{_fmt(m['value'])}</td><td>{html.escape(m['unit'])}</td>"
                           f"<td>{html.escape(m['expect'] or '')}</td>{_ok_cell(m['ok'], m.get('status'))}"
                           f"<td class='note'>{html.escape(m.get('note', ''))}</td></tr>")
            out.append("</table>")
        elif not run:
            out.append("<p class='none'>not run yet</p>")
        if name.startswith("11_") and (build / "capstone" / "summary.json").exists():
            out.append("<p>Its table and plots are on the front page (<a href='#top'>top</a>).</p>")
            continue
        out += [_img(png) for png in sorted((build / "figures").glob(f"{name[:2]}_*.png"))]
    path = build / "report.html"
    build.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(out))
    return path
