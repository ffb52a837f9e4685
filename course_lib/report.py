"""`build/report.html`: every chapter's status and time, every ledger figure with its expectation.

Written by the runner after each run (course_lib.runner); figures that chapters save with
`cl.save_figure` (build/figures/*.png) are embedded, so the page stands alone.
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
img{max-width:100%;border:1px solid #ddd;margin:.5em 0}code{background:#f6f6f6}"""


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return html.escape(json.dumps(value) if isinstance(value, (list, dict)) else str(value))


def _ok_cell(ok) -> str:
    if ok is None:
        return '<td class="none">-</td>'
    return '<td class="ok">ok</td>' if ok else '<td class="bad">FAIL</td>'


def write_report(build: Path) -> Path:
    runs_path = build / "runs.json"
    runs = json.loads(runs_path.read_text()) if runs_path.exists() else {}
    ledgers = {d["notebook"]: d for d in load_all(build / "results")}
    names = sorted(set(runs) | set(ledgers))
    out = [f"<!doctype html><meta charset='utf-8'><title>Workbook report</title><style>{_STYLE}</style>",
           "<h1>Workbook report</h1>", "<h2>Chapters</h2>",
           "<table><tr><th>notebook</th><th>profile</th><th>status</th><th>time (s)</th><th>claims ok</th></tr>"]
    for name in names:
        run, ledger = runs.get(name, {}), ledgers.get(name, {})
        claims = [m["ok"] for m in ledger.get("metrics", {}).values() if m["ok"] is not None]
        status = run.get("status", "-")
        out.append(f"<tr><td><a href='#{name}'>{name}</a></td><td>{run.get('profile', ledger.get('profile', '-'))}</td>"
                   f"<td class='{status}'>{status}</td><td>{run.get('seconds', 0):.1f}</td>"
                   f"<td>{sum(claims)} / {len(claims)}</td></tr>")
    out.append("</table>")
    for name in names:
        run, ledger = runs.get(name, {}), ledgers.get(name, {})
        out.append(f"<h2 id='{name}'>{name}</h2>")
        if run.get("error"):
            out.append(f"<pre class='failed'>{html.escape(run['error'])}</pre>")
        if ledger:
            out.append(f"<p>device <code>{html.escape(ledger['device'])}</code>, profile <code>{ledger['profile']}</code></p>")
            out.append("<table><tr><th>metric</th><th>value</th><th>unit</th><th>expected</th><th></th></tr>")
            for metric, m in ledger["metrics"].items():
                out.append(f"<tr><td>{html.escape(metric)}</td><td>{_fmt(m['value'])}</td><td>{html.escape(m['unit'])}</td>"
                           f"<td>{html.escape(m['expect'] or '')}</td>{_ok_cell(m['ok'])}</tr>")
            out.append("</table>")
        for png in sorted((build / "figures").glob(f"{name[:2]}_*.png")):
            data = base64.b64encode(png.read_bytes()).decode()
            out.append(f"<p><img alt='{png.stem}' src='data:image/png;base64,{data}'></p>")
    path = build / "report.html"
    build.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(out))
    return path
