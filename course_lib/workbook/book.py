"""The course as a book: `build/book/`, every chapter an HTML page that reads offline.

The runner (course_lib.workbook.runner) writes it after every run, beside build/report.html:
- `index.html`: the report's front page (course_lib.workbook.report); its chapter table links to the pages;
- `NN_name.html`: the chapter rendered by nbconvert from build/executed/NN_name.ipynb (text, code,
  outputs, figures, tables, formulas); its figures are files in `_images/` beside it, each with the title its
  cell gives it as alt text; a failed chapter shows its traceback at the cell that raised it
  and links there from the top; previous / contents / next links; at the bottom the ledger rows the
  chapter recorded, each linking to its row on the front page. A chapter not executed yet shows its
  code without outputs and says so. Previous / next run through the chapters only: a ledger no chapter wrote
  (the speed benchmark's, `bench_*`) has a page of its own, outside that sequence;
- `<label>/NN_name.html`: the same for each committed reference run (results/<label>/, e.g. a GPU's,
  laid out like build/: see course_lib.paths.reference_dirs), linked both ways with this machine's
  page; its figures are a column of every ledger table;
- `_static/tex-svg-full.js`: MathJax 3 (shipped by the django-static-mathjax package) with SVG output,
  so formulas render with no network. No page loads anything over http(s).

A page is rendered again only when something it shows changed (its notebook, run record, ledgers,
neighbours, this code), so rebuilding after every chapter (`make test` does) stays cheap.
"""
from __future__ import annotations

import hashlib
import html
import importlib.util
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from .. import paths
from . import report
from .results import claim_outcomes

MATHJAX = "tex-svg-full.js"
_KEYS = ".pages.json"  # what each page was rendered from, to skip unchanged ones

_TEMPLATE = r"""{%- extends 'index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{%- block html_head_js_mathjax -%}
{%- if resources.book.mathjax %}
<script>window.MathJax = {tex: {inlineMath: [['$', '$'], ['\\(', '\\)']], displayMath: [['$$', '$$'], ['\\[', '\\]']],
  processEscapes: true, processEnvironments: true}, svg: {fontCache: 'global'}};</script>
<script src="{{ resources.book.mathjax }}"></script>
{%- endif %}
{%- endblock html_head_js_mathjax -%}
{%- block extra_css -%}<style>{{ resources.book.css }}</style>{%- endblock extra_css -%}
{%- block body_header -%}{{ super() }}{{ resources.book.top }}{%- endblock body_header -%}
{%- block body_footer -%}{{ resources.book.bottom }}{{ super() }}{%- endblock body_footer -%}
{#- the lab template runs every code cell through an HTML sanitizer after Pygments; Pygments has already escaped the
    course's code, so the sanitizer found nothing to remove and took ~40% of a page's rendering time -#}
{% block input %}
<div class="jp-CodeMirrorEditor jp-Editor jp-InputArea-editor" data-type="inline">
     <div class="cm-editor cm-s-jupyter">
{{ cell.source | highlight_code(metadata=cell.metadata) }}
     </div>
</div>
{%- endblock input %}
{% block data_png scoped %}
<div class="jp-RenderedImage jp-OutputArea-output {{ extra_class }}">
{%- if 'image/png' in output.metadata.get('filenames', {}) %}
<img src="{{ output.metadata.filenames['image/png'] | posix_path | escape_html }}" loading="lazy"
{%- else %}
<img src="data:image/png;base64,{{ output.data['image/png'] | escape_html }}"
{%- endif %}
 alt="{{ output.metadata.get('alt', 'a figure') | escape_html }}">
</div>
{%- endblock data_png %}
"""

_CSS = """main{max-width:75em;margin:0 auto}
.book-nav{display:flex;justify-content:space-between;gap:1em;padding:.6em 1em;margin:.5em 0;background:#f3f5f7;
  border-radius:4px;font-family:system-ui,sans-serif}
.book-run{font-family:system-ui,sans-serif;padding:.6em 1em;margin:.5em 0 1em;border-left:4px solid #176917;background:#f4faf4}
.book-run.failed{border-color:#b00020;background:#fdf2f4}.book-run.not-run{border-color:#999;background:#f6f6f6}
.book-nav a,.book-run a,.book-ledger a{color:#0645ad}.book-run pre{white-space:pre-wrap;margin:.4em 0}.book-note{font-style:italic;color:#555}
.book-ledger{font-family:system-ui,sans-serif;margin:2em 1em}
.book-ledger table{border-collapse:collapse;margin:.5em 0 1.5em}
.book-ledger td,.book-ledger th{border:1px solid #ccc;padding:.25em .6em;text-align:left}
.book-ledger th{background:#f3f3f3}.ok{color:#176917}.bad{color:#b00020;font-weight:bold}.none,.note{color:#777}"""

_CHAPTER_LINK = re.compile(r"""href=(["'])(?:\.\./notebooks/|\./)?(\d\d_[\w-]+)\.ipynb(#[^"']*)?\1""")
_WIDGET_NOTE = ("<p class='book-note'>An interactive widget: it runs in JupyterLab (<code>make lab</code>, then "
                "open this chapter). Its figures are in the cells' other outputs and in the ledger below.</p>")


def _mathjax_file() -> Path | None:
    """MathJax 3's single-file TeX-to-SVG bundle, as the django-static-mathjax package installs it."""
    spec = importlib.util.find_spec("mathjax")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "static" / "mathjax" / "es5" / MATHJAX
        if path.exists():
            return path
    return None


def _exporter():
    import jinja2
    from nbconvert import HTMLExporter

    return HTMLExporter(template_name="lab", template_file="book.html.j2", optimistic_validation=True,
                        extra_loaders=[jinja2.DictLoader({"book.html.j2": _TEMPLATE})])


def _run_box(name: str, run: dict, ledger: dict, executed: bool, other: str, anchor: bool) -> str:
    """The box under the navigation: status, time, parameters, the ledger's totals, the other runs."""
    status = report.status_of(run, ledger)
    css = "failed" if status == "failed" else "not-run" if not executed else "ok"
    bits = [f"<b>{html.escape(name)}</b>: {html.escape(status)}"]
    if run.get("seconds") is not None:
        bits.append(f"in {run['seconds']:.1f} s")
    bits += [f"{k} <code>{html.escape(str(ledger.get(k) or run.get(k)))}</code>" for k in ("profile", "device")
             if ledger.get(k) or run.get(k)]
    text = ", ".join(bits)
    if run.get("parameters"):
        shown = ", ".join(f"{k}={v!r}" for k, v in run["parameters"].items())
        text += f"; parameters set: <code>{html.escape(shown)}</code>"
    claims = claim_outcomes(ledger.get("metrics", {}))
    if ledger.get("metrics"):
        text += (f". <a href='#ledger'>{len(ledger['metrics'])} figures recorded, "
                 f"{sum(claims)} / {len(claims)} claims held</a>")
    if not executed:
        text += (". <b>Not executed in this build</b>: the code below has no outputs "
                 f"(<code>make run ONLY={html.escape(name[:2])}</code> runs it)")
    if run.get("error"):
        text += f"<pre>{html.escape(run['error'])}</pre>"
        text += "<a href='#papermill-error-cell'>Go to the cell that failed</a>" if anchor else ""
    return f"<div class='book-run {css}'>{text}{other}</div>"


def _nav(names: list[str], i: int | None, contents: str, extra: str = "") -> str:
    """Previous / contents / next; `i` None: a page outside the chapters' sequence (contents only)."""
    prev = f"<a rel='prev' href='{names[i - 1]}.html'>&larr; {names[i - 1]}</a>" if i else "<span></span>"
    nxt = (f"<a rel='next' href='{names[i + 1]}.html'>{names[i + 1]} &rarr;</a>" if i is not None and i + 1 < len(names)
           else "<span></span>")
    return f"<nav class='book-nav'>{prev}<span><a href='{contents}'>Contents</a>{extra}</span>{nxt}</nav>"


def _read(path: Path, images: Path | None = None):
    """The notebook, with each interactive widget replaced by a note (its state needs a JS widget
    manager that would come from a CDN) and papermill's error anchor kept. Each PNG gets its alt text (the
    titles its cell sets, `report.figure_alt`) and, with `images` (a folder beside the page), is written there
    as a file the page links to instead of carrying it inline."""
    import base64

    import nbformat

    nb = nbformat.read(path, as_version=4)
    nb.metadata.pop("widgets", None)
    for i, cell in enumerate(nb.cells):
        pngs = [out for out in cell.get("outputs", []) if "image/png" in out.get("data", {})]
        alt = report.figure_alt(cell.source, f"figure {{}} of cell {i} in {path.stem}") if pngs else ""
        for k, out in enumerate(pngs, 1):
            out.setdefault("metadata", {})["alt"] = alt.replace("{}", str(k)) + (f" ({k} of {len(pngs)})" if len(pngs) > 1 else "")
            if images is not None:
                images.mkdir(parents=True, exist_ok=True)
                file = images / f"{path.stem}_{i:03d}_{k}.png"
                file.write_bytes(base64.b64decode(out["data"]["image/png"]))
                out["metadata"].setdefault("filenames", {})["image/png"] = f"{images.name}/{file.name}"
        for out in cell.get("outputs", []):
            if "application/vnd.jupyter.widget-view+json" in out.get("data", {}):
                out["data"] = {"text/html": _WIDGET_NOTE}
    return nb


def _page(exporter, source: Path | None, title: str, top: str, bottom: str, mathjax: str | None, href,
          images: Path | None = None) -> str:
    """One page: the notebook through nbconvert's lab template, or the boxes alone when there is none.
    `href(name)`: where a link to chapter `name` (written NN_name.ipynb in the notebook) leads; `images`: the
    folder beside the page its figures are written to."""
    book = {"top": top, "bottom": bottom, "css": _CSS, "mathjax": mathjax}
    if source is None:
        return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
                f"<style>{_CSS}</style></head><body><main>{top}{bottom}</main></body></html>")
    body, _ = exporter.from_notebook_node(_read(source, images), resources={"metadata": {"name": title}, "book": book})
    return _CHAPTER_LINK.sub(lambda m: f"href={m[1]}{href(m[2])}{m[3] or ''}{m[1]}", body)


def _key(*parts) -> str:
    code = Path(__file__).read_bytes() + Path(report.__file__).read_bytes()
    stamp = [(str(p), p.stat().st_mtime_ns, p.stat().st_size) if isinstance(p, Path) else p for p in parts]
    return hashlib.sha256(code + json.dumps(stamp, sort_keys=True, default=str).encode()).hexdigest()


@dataclass
class _Shelf:
    """One set of pages: this machine's run (label "") or a reference run's (label, in book/<label>/)."""
    label: str
    chapters: list[str]  # the chapters' sequence (previous / next)
    data: dict  # {"runs": ..., "ledgers": ..., "dir": the reference folder}
    others: dict  # the runs whose figures make the extra ledger columns
    up: str  # from a page to book/
    others_pages: list[str]  # ledgers no chapter wrote (the speed benchmark's): a page each, outside the sequence

    def executed(self, name: str, build: Path) -> Path:
        return (self.data["dir"] if self.label else build) / "executed" / f"{name}.ipynb"

    def source(self, name: str, build: Path) -> Path | None:
        """The executed notebook, else (this machine's chapters only) the notebook without outputs."""
        for path in (self.executed(name, build), None if self.label else paths.NOTEBOOKS / f"{name}.ipynb"):
            if path and path.exists():
                return path
        return None

    def href(self, name: str) -> str:
        """A link to chapter `name`: on this shelf if it has the chapter, else this machine's page."""
        return f"{name}.html" if name in self.chapters else f"{self.up}{name}.html"

    def pages(self) -> list[tuple[str, int | None]]:
        """(name, position in the chapters' sequence): the chapters, then the ledgers of no chapter (None)."""
        return [(n, i) for i, n in enumerate(self.chapters)] + [(n, None) for n in self.others_pages]


def _shelves(build: Path, refs: dict) -> list[_Shelf]:
    runs, ledgers, names = report.load(build)
    this = {"runs": runs, "ledgers": ledgers}
    def split(found):  # (chapters, other ledgers)
        return [n for n in found if report.is_chapter(n)], [n for n in found if not report.is_chapter(n)]

    chapters, others = split(names)
    shelves = [_Shelf("", chapters, this, refs, "", others)]
    for label, r in refs.items():
        found = sorted(set(r["runs"]) | set(r["ledgers"]) | {p.stem for p in (r["dir"] / "executed").glob("*.ipynb")})
        chapters, others = split(found)
        shelves.append(_Shelf(label, chapters, r, {"this machine": this}, "../", others))
    return shelves


def _other_runs(shelf: _Shelf, name: str, shelves: list[_Shelf]) -> str:
    """Links from a page to the same chapter in the other shelves."""
    if shelf.label:
        mine = (f"; <a href='../{name}.html'>this machine's run</a>"
                if name in shelves[0].chapters + shelves[0].others_pages else "")
        stale = report.stale_note(shelf.data, name)  # its code is not the chapter's now: the page says so first
        return f" Reference run <b>{html.escape(shelf.label)}</b>{mine}." + (f" <b>{html.escape(stale)}.</b>" * bool(stale))
    return "".join(f" <a href='{s.label}/{name}.html'>Also run on {html.escape(s.label)}</a>"
                   + (" (stale: an earlier version of this chapter)." if report.stale_note(s.data, name) else ".")
                   for s in shelves[1:] if name in s.chapters + s.others_pages)


def write_book(build: Path, refs: dict | None = None) -> tuple[Path, int]:
    """Write build/book/; return its index.html and how many chapter pages were (re)rendered."""
    refs = report.references() if refs is None else refs
    book = build / "book"
    (book / "_static").mkdir(parents=True, exist_ok=True)
    mathjax = _mathjax_file()
    if mathjax and not (book / "_static" / MATHJAX).exists():
        shutil.copyfile(mathjax, book / "_static" / MATHJAX)
    keys_path = book / _KEYS
    old = json.loads(keys_path.read_text()) if keys_path.exists() else {}
    keys, exporter, rendered = {}, None, 0
    shelves = _shelves(build, refs)
    for shelf in shelves:
        index = f"{shelf.up}index.html"
        for name, i in shelf.pages():
            run, ledger = shelf.data["runs"].get(name, {}), shelf.data["ledgers"].get(name, {})
            source, other = shelf.source(name, build), _other_runs(shelf, name, shelves)
            ref_ledgers = {label: r["ledgers"].get(name) for label, r in shelf.others.items()}
            page = book / shelf.label / f"{name}.html"
            keys[f"{shelf.label}/{name}"] = key = _key(source, run, ledger, ref_ledgers, shelf.chapters, other, bool(mathjax))
            if page.exists() and old.get(f"{shelf.label}/{name}") == key:
                continue  # nothing it shows has changed
            nav = _nav(shelf.chapters, i, f"{index}#contents")
            anchor = bool(run.get("error")) and source is not None and "papermill-error-cell" in source.read_text()
            executed = shelf.executed(name, build).exists() or bool(shelf.label) or i is None  # (a ledger alone: no notebook)
            top = nav + _run_box(name, run, ledger, executed, other, anchor)
            table = report.ledger_table(name, ledger, shelf.others, link=index) if ledger or any(ref_ledgers.values()) else ""
            bottom = (f"<section class='book-ledger' id='ledger'><h2>Ledger</h2>{table or '<p>nothing recorded</p>'}"
                      f"</section>{nav}")
            exporter = exporter or (_exporter() if source else None)
            page.parent.mkdir(parents=True, exist_ok=True)
            page.write_text(_page(exporter, source, name, top, bottom,
                                  f"{shelf.up}_static/{MATHJAX}" if mathjax else None, shelf.href,
                                  images=page.parent / "_images"))
            rendered += 1
    (book / "index.html").write_text(report.render(build, "", refs))
    keys_path.write_text(json.dumps(keys, indent=1))
    return book / "index.html", rendered
