"""The book (course_lib.workbook.book) and parameters through the runner.

A small synthetic course (three chapters: one that runs with SET values and has formulas, a figure and
a table, one that fails half-way, one never run) and a synthetic reference run (results/<label>/) go
through the real runner into a temporary build. Then:
- every link inside build/book resolves to a file (and its #fragment to an element), no page loads an
  http(s) resource, chapter pages link to their ledger rows and the report's rows link to the pages;
- the failed chapter has its page with the error where it happened; the reference run has its pages
  and a column in the ledger tables; unchanged pages are not rendered again;
- SET: values parsed as literals, injected into the executed notebook's parameters; an unknown name
  fails with one line listing the chapter's parameters (through `make run` too);
- headless Chromium with the network off opens the pages: images load, formulas render, nothing is
  fetched. The real build's book (chapters 00 and 10, run here when missing) is checked the same way,
  and a screenshot of chapter 10's page goes to build/figures/book_chapter_10.png.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from contextlib import contextmanager
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import nbformat
import pytest
from conftest import schedule
from test_browser import browser  # noqa: F401  (the same headless Chromium, skipping the same way)

from course_lib.workbook import book, report, runner
from course_lib import paths
from course_lib.paths import REPO_ROOT, build_dir

KERNEL = {"name": "llm-course", "display_name": "Python (LLM course)", "language": "python"}
REF = "gpu-test"


def _notebook(path: Path, params: str, *cells) -> Path:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(params, metadata={"tags": ["parameters"]})])
    for kind, text in cells:
        nb.cells.append(nbformat.v4.new_markdown_cell(text) if kind == "md" else nbformat.v4.new_code_cell(text))
    nb.metadata["kernelspec"] = KERNEL
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def _course(root: Path) -> None:
    """Three chapters and a reference run, written under `root`."""
    nbs = root / "notebooks"
    _notebook(nbs / "00_alpha.ipynb", 'profile = "auto"\nsteps = None\nlabel = "default"',
              ("md", "# 00 · Alpha\nThe rule: $$\\text{peak}(k) \\approx \\tfrac{n}{k}\\,x + k\\,a,$$ and inline "
                     "$B_\\text{eff} = b \\times k$. Next: [chapter 01](01_beta.ipynb)."),
              ("code", "from course_lib.workbook.results import Ledger, save_figure\n"
                       "ledger = Ledger('00_alpha', profile=profile, device='cpu')\n"
                       "print(f'steps={steps!r} label={label!r}')\n"
                       "ledger.check('steps_seen', steps, 'steps', expect=3)\nledger.record('speed', 1.5, 's')\n"
                       "Ledger('bench_alpha', profile=profile, device='cpu').record('tokens_per_s', 10.0, 'tokens/s')"),
              ("code", "import matplotlib.pyplot as plt\nfig, ax = plt.subplots(figsize=(3, 2))\n"
                       "ax.plot([1, 2, 3], [2, 1, 3]); ax.set_title(f'Alpha, {steps} steps')\n"
                       "save_figure(fig, '00_alpha_curve')\nplt.show()"),
              ("code", "from IPython.display import HTML\n"
                       "HTML('<table><tr><th>config</th><th>GB</th></tr><tr><td>fp32</td><td>16</td></tr></table>')"))
    _notebook(nbs / "01_beta.ipynb", 'profile = "auto"',
              ("code", "from course_lib.workbook.results import Ledger\nledger = Ledger('01_beta', profile=profile, device='cpu')\n"
                       "ledger.record('before', 1.0, 'B')"),
              ("code", "ledger.check('two', 1 + 1, '', expect=3, note='made to fail')"),
              ("code", "print('never reached')"))
    _notebook(nbs / "02_gamma.ipynb", 'profile = "auto"', ("md", "# 02 · Gamma, never run"), ("code", "x = 1"))
    ref = root / "results" / REF
    (ref / "results").mkdir(parents=True)
    (ref / "results" / "00_alpha.json").write_text(json.dumps({
        "notebook": "00_alpha", "profile": "gpu", "device": "cuda:0", "metrics": {
            "steps_seen": {"value": 3, "unit": "steps", "expect": "3 (exact)", "ok": True},
            "speed": {"value": 0.01, "unit": "s", "expect": None, "ok": None},
            "gpu_only": {"value": 7, "unit": "GB", "expect": None, "ok": None, "status": "skipped", "why": "no TF"}}}))
    (ref / "runs.json").write_text(json.dumps({"00_alpha": {"notebook": "00_alpha", "status": "ok", "seconds": 2.0}}))
    executed = nbformat.read(nbs / "00_alpha.ipynb", as_version=4)
    executed.cells[2].outputs = [nbformat.v4.new_output("stream", name="stdout", text="run on the reference GPU\n")]
    (ref / "executed").mkdir()
    nbformat.write(executed, ref / "executed" / "00_alpha.ipynb")


@contextmanager
def _inside(root: Path):
    """The synthetic course in place of the real one: its notebooks, build folder and references."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(paths, "NOTEBOOKS", root / "notebooks")
        mp.setenv("COURSE_BUILD_DIR", str(root / "build"))
        mp.setenv("COURSE_REFERENCES", str(root / "results"))
        yield


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    """The synthetic course run through the runner: 00 with SET values, then 01 (fails); 02 never."""
    root = tmp_path_factory.mktemp("course")
    _course(root)
    with _inside(root):
        first = runner.run("cpu", only="00", sets=["steps=3 label='from SET'"])
        second = runner.run("cpu", only="01")
    return root / "build", first + second


# ---------------------------------------------------------------- reading pages

class _Page(HTMLParser):
    """Links, resources and ids of one HTML page."""

    RESOURCES = {("script", "src"), ("link", "href"), ("img", "src"), ("iframe", "src"), ("source", "src"),
                 ("video", "src"), ("audio", "src"), ("embed", "src"), ("object", "data"), ("image", "href")}

    def __init__(self, text: str):
        super().__init__()
        self.links, self.resources, self.ids, self.styles, self._in_style = [], [], set(), [], False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("name"):
            self.ids.add(attrs["name"])
        if tag == "a" and attrs.get("href"):
            self.links.append(attrs["href"])
        for (t, attr) in self.RESOURCES:
            if tag == t and attrs.get(attr):
                self.resources.append(attrs[attr])
        if attrs.get("style"):
            self.styles.append(attrs["style"])
        self._in_style = tag == "style"

    def handle_data(self, data):
        if self._in_style:
            self.styles.append(data)

    def handle_endtag(self, tag):
        self._in_style = False


def check_book(folder: Path) -> dict[str, _Page]:
    """Every page under `folder`: relative links and resources resolve to files (fragments to ids),
    nothing loads from http(s) (scripts, styles, images, CSS url()/@import). Returns the parsed pages."""
    pages = {p: _Page(p.read_text()) for p in sorted(folder.rglob("*.html"))}
    assert pages, f"no pages under {folder}"
    problems = []
    for path, page in pages.items():
        where = path.relative_to(folder)
        web = [r for r in page.resources if re.match(r"(?i)\s*(https?:)?//", r)]
        web += [u for s in page.styles for u in re.findall(r"""(?i)(?:url\(\s*['"]?|@import\s+['"])((?:https?:)?//[^'")\s]+)""", s)]
        problems += [f"{where}: loads {u}" for u in web]
        for ref in page.links + page.resources:
            parts = urlsplit(ref)
            if parts.scheme in ("http", "https", "data", "mailto") or ref.startswith("//"):
                continue
            assert not parts.scheme, f"{where}: unexpected link {ref}"
            target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
            if not target.is_file():
                problems.append(f"{where}: {ref} -> no such file")
            elif parts.fragment:
                ids = pages[target].ids if target in pages else _Page(target.read_text()).ids
                if not {parts.fragment, unquote(parts.fragment)} & ids:  # as browsers look it up: raw, then decoded
                    problems.append(f"{where}: {ref} -> no element with that id")
    assert not problems, "\n".join(problems[:20])
    return {str(p.relative_to(folder)): page for p, page in pages.items()}


# ---------------------------------------------------------------- the synthetic course

@pytest.mark.slow
def test_runs_went_as_designed(course):
    build, outcomes = course
    assert [(o.notebook, o.status) for o in outcomes] == [("00_alpha", "ok"), ("01_beta", "failed")], outcomes
    assert outcomes[0].parameters == {"steps": 3, "label": "from SET"}
    assert json.loads((build / "runs.json").read_text())["00_alpha"]["parameters"] == {"steps": 3, "label": "from SET"}


def test_set_values_appear_in_the_executed_parameters_cell(course):
    build, _ = course
    nb = nbformat.read(build / "executed" / "00_alpha.ipynb", as_version=4)
    injected = [c for c in nb.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert len(injected) == 1 and "steps = 3" in injected[0].source and 'label = "from SET"' in injected[0].source
    assert "steps=3 label='from SET'" in "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    page = (build / "book" / "00_alpha.html").read_text()
    assert "parameters set: <code>steps=3, label='from SET'</code>" in page  # in the box at the top
    assert '<span class="s2">"from SET"</span>' in page  # in the injected cell


def test_every_link_resolves_and_nothing_comes_from_the_web(course):
    build, _ = course
    pages = check_book(build / "book")
    assert {"index.html", "00_alpha.html", "01_beta.html", "02_gamma.html", f"{REF}/00_alpha.html"} <= set(pages)
    assert "01_beta.html" in pages["00_alpha.html"].links, "a markdown link to 01_beta.ipynb leads to its page"
    assert (build / "book" / "_static" / book.MATHJAX).stat().st_size > 1_000_000, "MathJax is bundled"


def test_pages_link_their_ledger_rows_and_the_report_links_the_pages(course):
    build, _ = course
    pages = check_book(build / "book")
    row = report.row_id("00_alpha", "steps_seen")
    assert f"index.html#{row}" in pages["00_alpha.html"].links and row in pages["index.html"].ids
    assert "00_alpha.html" in pages["index.html"].links and "01_beta.html" in pages["index.html"].links
    front = _Page((build / "report.html").read_text())
    assert {"book/index.html", "book/00_alpha.html", "book/01_beta.html"} <= set(front.links)
    assert all((build / link).is_file() for link in front.links if link.startswith("book/"))


def test_navigation_and_a_chapter_never_run(course):
    build, _ = course
    pages = check_book(build / "book")
    assert {"01_beta.html", "index.html#contents"} <= set(pages["00_alpha.html"].links)
    assert {"00_alpha.html", "02_gamma.html"} <= set(pages["01_beta.html"].links)
    gamma = (build / "book" / "02_gamma.html").read_text()
    assert "Not executed in this build" in gamma and "02 · Gamma, never run" in gamma


def test_chapters_only_in_the_sequence_and_a_benchmark_page_of_its_own(course):
    """A ledger no chapter wrote (cl.bench's) is not a chapter: not counted, not in previous / next, its own page."""
    build, _ = course
    pages = check_book(build / "book")
    assert "bench_alpha.html" in pages and "bench_alpha.html" not in pages["02_gamma.html"].links
    bench = (build / "book" / "bench_alpha.html").read_text()
    assert "rel='next'" not in bench and "rel='prev'" not in bench and "Not executed" not in bench
    index = (build / "book" / "index.html").read_text()
    assert "3 chapters:" in index and "<h2>Other ledgers</h2>" in index and "bench_alpha.html" in pages["index.html"].links


def test_figures_are_files_with_their_titles_as_alt_text(course):
    build, _ = course
    page = (build / "book" / "00_alpha.html").read_text()
    imgs = re.findall(r"<img [^>]*>", page)
    assert len(imgs) == 1 and "src=\"data:image" not in page and 'src="_images/00_alpha_' in imgs[0], imgs
    assert 'alt="Alpha, … steps"' in imgs[0], imgs  # the title the cell sets (an f-string's field as …)
    assert (build / "book" / re.search(r'src="([^"]+)"', imgs[0])[1]).stat().st_size > 1000
    index = (build / "book" / "index.html").read_text()
    assert "data:image" not in index and "alt='Alpha, … steps' src='../figures/00_alpha_curve.png'" in index


def test_a_failed_chapter_has_its_page_with_the_error_where_it_happened(course):
    build, _ = course
    page = (build / "book" / "01_beta.html").read_text()
    parsed = check_book(build / "book")["01_beta.html"]
    assert "#papermill-error-cell" in parsed.links and "papermill-error-cell" in parsed.ids
    error_at = page.index('id="papermill-error-cell"')
    assert page.index("AssertionError", error_at) < page.index("never reached"), "the traceback sits at the failing cell"
    assert "made to fail" in page and "book-run failed" in page


def test_the_reference_run_is_a_second_book_and_a_column(course):
    build, _ = course
    pages = check_book(build / "book")
    assert f"{REF}/00_alpha.html" in pages["00_alpha.html"].links
    assert "../00_alpha.html" in pages[f"{REF}/00_alpha.html"].links
    ref_page = (build / "book" / REF / "00_alpha.html").read_text()
    assert "run on the reference GPU" in ref_page
    ours = (build / "book" / "00_alpha.html").read_text()
    assert f"<th>{REF}</th>" in ours and "0.01 s" in ours and "gpu_only" in ours
    assert "why: no TF" in ref_page and ">skipped<" in ref_page  # fields the report does not know are shown
    index = (build / "book" / "index.html").read_text()
    assert f"<th>{REF}</th>" in index and "7 GB (skipped)" in index


def test_unchanged_pages_are_not_rendered_again(course):
    build, _ = course
    with _inside(build.parent):
        assert book.write_book(build)[1] == 0
        ledger = json.loads((build / "results" / "01_beta.json").read_text())
        ledger["metrics"]["before"]["value"] = 2.0
        (build / "results" / "01_beta.json").write_text(json.dumps(ledger))
        assert book.write_book(build)[1] == 1  # 01's page shows its ledger; no other page changed


# ---------------------------------------------------------------- SET

def test_parse_sets():
    assert runner.parse_sets(["steps=3 lr=1e-3", "model_path=/models/x on=True none=None",
                              "name='two words'", "ids=[1,2]", "pair='(1, 2)'", "quoted='\"3\"'"]) == {
        "steps": 3, "lr": 1e-3, "model_path": "/models/x", "on": True, "none": None, "name": "two words",
        "ids": [1, 2], "pair": (1, 2), "quoted": "3"}
    with pytest.raises(ValueError, match="name=value"):
        runner.parse_sets(["steps"])
    with pytest.raises(ValueError, match="PROFILE="):
        runner.parse_sets(["profile=gpu"])


def test_an_unknown_parameter_fails_with_one_line_listing_the_chapters(capsys):
    from papermill.inspection import inspect_notebook

    chapter = paths.all_notebooks()[0]
    assert runner.main(["--profile", "cpu", "--only", "00", "--set", "nonexistent=1"]) == 2
    captured = capsys.readouterr()
    expected = (f"error: {chapter.stem} has no parameter 'nonexistent'; "
                f"its parameters: {', '.join(inspect_notebook(str(chapter)))}")
    assert captured.err.splitlines() == [expected] and not captured.out


def test_make_run_passes_set_and_fails_in_one_line(tmp_path):
    """`make run ONLY=00 SET="nonexistent=1"` with a venv whose python is this one (install skipped)."""
    (tmp_path / "bin").mkdir()
    stub = tmp_path / "bin" / "python"
    stub.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    stub.chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(["make", "-s", "-o", "install", "run", f"VENV={tmp_path}", "ONLY=00", "SET=nonexistent=1"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    ours = [ln for ln in (done.stdout + done.stderr).splitlines() if not ln.startswith("make")]
    assert done.returncode != 0 and len(ours) == 1, done.stdout + done.stderr
    assert ours[0].startswith("error: 00_") and "its parameters: profile" in ours[0]


def test_set_without_only_goes_to_the_chapters_that_define_it(capsys):
    books = paths.all_notebooks()
    chosen = runner.parameters_for(books, {"model_path": "/models/x"}, only=False)
    takers = [stem for stem, values in chosen.items() if values]
    assert takers and len(takers) < len(books) and all(chosen[s] == {"model_path": "/models/x"} for s in takers)
    said = capsys.readouterr().out.strip()
    assert said.startswith("SET model_path='/models/x' goes to the chapters that define it: ")
    assert said.endswith(", ".join(s[:2] for s in takers))
    with pytest.raises(ValueError, match="no chapter has a parameter 'nonexistent'"):
        runner.parameters_for(books, {"nonexistent": 1}, only=False)


# ---------------------------------------------------------------- in a browser, network off

def open_offline(browser, path: Path, shot: Path | None = None) -> dict:  # noqa: F811
    """Open a page from disk with the network off; wait for MathJax and for every figure, the ones below the
    fold too; return what the page shows. Fails on any request that is not a local file or data: URL, and on any failed request."""
    context = browser.new_context(offline=True, viewport={"width": 1300, "height": 1000})
    remote, failed = [], []
    context.route(re.compile(r"^(https?|wss?|ftp):"), lambda route: (remote.append(route.request.url), route.abort()))
    page = context.new_page()
    page.on("requestfailed", lambda r: failed.append(f"{r.url}: {r.failure}"))
    page.goto(path.as_uri(), wait_until="load")
    page.wait_for_function("() => !window.MathJax || (MathJax.startup && MathJax.startup.promise)", timeout=20_000)
    seen = page.evaluate("""async () => {
        if (window.MathJax) await MathJax.startup.promise;
        // the pages load figures lazily (loading='lazy'): a long page's lower figures would never load here
        await Promise.all([...document.images].map(i => { i.loading = 'eager'; return i.decode().catch(() => null); }));
        const formulas = [...document.querySelectorAll('mjx-container')];
        return {images: [...document.images].map(i => ({src: i.src.slice(0, 40), ok: i.complete && i.naturalWidth > 0})),
                formulas: formulas.length,
                drawn: formulas.filter(f => { const s = f.querySelector('svg'); const r = s && s.getBoundingClientRect();
                                              return r && r.width > 0 && r.height > 0; }).length,
                errors: document.querySelectorAll('mjx-merror, [data-mjx-error]').length,
                raw_tex: [...document.querySelectorAll('.jp-RenderedMarkdown')].some(e => e.innerText.includes('$$')),
                mathjax: !!window.MathJax};
    }""")
    if shot:
        shot.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(shot))
    context.close()
    assert not remote, f"{path.name} asked the network for {remote}"
    assert not failed, f"{path.name}: failed requests {failed}"
    assert all(i["ok"] for i in seen["images"]), f"{path.name}: images that did not load: {seen['images']}"
    assert seen["formulas"] == seen["drawn"] and not seen["errors"] and not seen["raw_tex"], f"{path.name}: {seen}"
    return seen


@pytest.mark.browser
def test_the_book_offline_in_chromium(course, browser):  # noqa: F811
    build, _ = course
    index = open_offline(browser, build / "book" / "index.html")
    assert len(index["images"]) >= 1  # the chapter's saved figure, from its file
    alpha = open_offline(browser, build / "book" / "00_alpha.html")
    assert alpha["mathjax"] and alpha["formulas"] == 2 and len(alpha["images"]) == 1
    open_offline(browser, build / "book" / "01_beta.html")
    open_offline(browser, build / "book" / REF / "00_alpha.html")


# ---------------------------------------------------------------- the real build

@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.xdist_group("chapters")  # after 00 and 10, in their worker (tests/test_notebooks.py's IN_ORDER)
def test_the_real_book_offline_with_chapter_10(browser):  # noqa: F811
    """After `make run` the book is there; from a fresh clone, chapters 00 and 10 run here first."""
    build = build_dir()
    runs = json.loads((build / "runs.json").read_text()) if (build / "runs.json").exists() else {}
    names = {p.stem[:2]: p.stem for p in paths.all_notebooks()}
    missing = [n for n in ("00", "10") if runs.get(names[n], {}).get("status") != "ok"
               or not (build / "executed" / f"{names[n]}.ipynb").exists()]
    if missing:
        outcomes = runner.run("cpu", only=",".join(missing))
        assert all(o.status == "ok" for o in outcomes), [o.error for o in outcomes]
    else:
        book.write_book(build)
    check_book(build / "book")
    open_offline(browser, build / "book" / "index.html")
    open_offline(browser, build / "book" / f"{names['00']}.html")
    with_math = [name for name in names.values() if "$$" in (paths.NOTEBOOKS / f"{name}.ipynb").read_text()]
    for name in with_math[:2]:
        assert open_offline(browser, build / "book" / f"{name}.html")["formulas"] > 0, name
    seen = open_offline(browser, build / "book" / f"{names['10']}.html", shot=build / "figures" / "book_chapter_10.png")
    assert seen["images"], "chapter 10's page shows its figures"


def _record_many(build: Path, who: str) -> None:
    for i in range(40):
        runner.record_run(build, f"{who}_{i:02d}", {"notebook": f"{who}_{i:02d}", "status": "ok", "seconds": 1.0})


def test_two_runners_writing_one_build_keep_each_others_chapters(tmp_path):
    """build/runs.json is read and replaced under a lock: two runners finishing chapters at once lose none (the test
    suite's two workers run chapters into one build/; the real book reads which of them ran)."""
    import multiprocessing

    procs = [multiprocessing.get_context("fork").Process(target=_record_many, args=(tmp_path, w)) for w in "ab"]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
    runs = json.loads((tmp_path / "runs.json").read_text())
    assert sorted(runs) == sorted(f"{w}_{i:02d}" for w in "ab" for i in range(40))


def test_report_and_book_do_not_import_the_runner():
    """The runner imports the report and the book, never the other way (paths come from course_lib.paths)."""
    code = ("import sys, course_lib.workbook.report, course_lib.workbook.book, course_lib.workbook.results; "
            "print('course_lib.workbook.runner' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert done.stdout.strip() == "False", done.stdout + done.stderr


# ---------------------------------------------------------------- --jobs

def test_jobs_plan_keeps_timed_chapters_alone_and_readers_after_what_they_read():
    """`startable` over the real chapters, two slots, each chapter taking as long as its number + 1: every chapter
    runs once; the TIMED ones after all the others, each with nothing beside it; a READS one after the chapter it
    reads has finished; and chapters do run side by side."""
    spans = schedule({b.stem[:2]: int(b.stem[:2]) + 1 for b in paths.all_notebooks()}, 2)
    assert len(spans) == len(paths.all_notebooks())
    beside = {n: [o for o, (s, e) in spans.items() if o != n and s < end and start < e] for n, (start, end) in spans.items()}
    for num in spans:
        assert not (num in runner.TIMED and beside[num]), (num, beside[num])
        assert all(spans[r][1] <= spans[num][0] for r in runner.READS.get(num, ()) if r in spans), num
    untimed = [n for n in spans if n not in runner.TIMED]
    assert max(spans[n][1] for n in untimed) <= min(spans[n][0] for n in runner.TIMED) and any(beside.values())


def test_the_schedule_takes_a_kernel_started_ahead_off_the_next_chapter():
    """`schedule(..., warm_s)` (conftest) as `run(warm=True)` works: one kernel started ahead at a time, for the chapter
    that would start next; it saves the next chapter up to warm_s, no more than the time it had to warm."""
    spans = schedule({"00": 20, "01": 20, "03": 20}, 1, warm_s=5)
    assert spans == {"00": (0, 20), "01": (20, 35), "03": (35, 50)}
    spans = schedule({"00": 2, "01": 20, "03": 20}, 1, warm_s=5)
    assert spans == {"00": (0, 2), "01": (2, 20), "03": (20, 35)}  # 01's kernel had 2 s to start
    spans = schedule({"00": 20, "01": 20, "03": 20}, 1, warm_s={"01": 5, "03": 8})  # per chapter
    assert spans == {"00": (0, 20), "01": (20, 35), "03": (35, 47)}
    assert runner.next_to_warm([b for b in paths.all_notebooks() if b.stem[:2] in ("02", "03")], 1).stem[:2] == "03"


@pytest.mark.slow
def test_the_gpu_profile_starts_the_next_kernel_ahead(tmp_path):
    """`warm` (the gpu profile's default), for real with the cpu profile: while 00 runs, 01's kernel starts in its
    folder with its COURSE_CHAPTER and WARM_IMPORTS done, outside its history (the same execution counts); 01 then
    runs on it; a chapter that fails on a kernel started ahead fails as it would on its own."""
    nbs = tmp_path / "notebooks"
    probe = ("import json, os, sys, time, pathlib\n"
             "seen = dict(warm='course_lib' in sys.modules, chapter=os.environ['COURSE_CHAPTER'], cwd=os.getcwd(),\n"
             "            count=get_ipython().execution_count)\n"
             "out = pathlib.Path(os.environ['COURSE_BUILD_DIR']) / 'seen'\nout.mkdir(parents=True, exist_ok=True)\n"
             "(out / (seen['chapter'] + '.json')).write_text(json.dumps(seen))\ntime.sleep({})")
    _notebook(nbs / "00_first.ipynb", 'profile = "auto"', ("code", probe.format(5)))
    _notebook(nbs / "01_second.ipynb", 'profile = "auto"', ("code", probe.format(0)))
    _notebook(nbs / "02_fails.ipynb", 'profile = "auto"', ("code", "raise ValueError('on a kernel started ahead')"))
    with _inside(tmp_path):
        outcomes = runner.run("cpu", warm=True)
    assert [(o.notebook, o.status) for o in outcomes] == [("00_first", "ok"), ("01_second", "ok"), ("02_fails", "failed")]
    assert "on a kernel started ahead" in outcomes[2].error and outcomes[1].warm_seconds > 0 == outcomes[0].warm_seconds
    seen = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "build" / "seen").glob("*.json")}
    assert not seen["00_first"]["warm"] and seen["01_second"]["warm"]  # 00 started its own kernel, 01's was ready
    assert seen["01_second"]["chapter"] == "01_second" and seen["01_second"]["cwd"] == str(nbs)
    assert seen["01_second"]["count"] == seen["00_first"]["count"]


@pytest.mark.slow
def test_chapter_02s_kernel_started_ahead_has_tensorflow_and_keras_imported():
    """runner.WARM_MORE: chapter 02's first cell imports TensorFlow and Keras, so its kernel started ahead does too."""
    pytest.importorskip("tensorflow")
    from course_lib.workbook.runner import WARM_MORE, warm_kernel

    assert all((paths.REPO_ROOT / "notebooks" / f"{stem}.ipynb").is_file() for stem in WARM_MORE)
    km = warm_kernel(paths.REPO_ROOT / "notebooks" / "02_mixed_precision_keras.ipynb")
    assert km is not None
    try:
        kc = km.client()
        kc.start_channels()
        reply = kc.execute_interactive("import sys\nassert {'tensorflow', 'keras'} <= set(sys.modules)",
                                       store_history=False, timeout=60)
        kc.stop_channels()
    finally:
        km.shutdown_kernel(now=True)
    assert reply["content"]["status"] == "ok", reply["content"]


@pytest.mark.slow
def test_jobs_two_runs_two_chapters_at_a_time_for_real(tmp_path):
    """The process pool for real, on four small notebooks: 03 and 06 side by side, 07 after 06 (it reads 06),
    02 (timed) last, with nothing beside it; the outcomes come back in chapter order; the GPU profile refuses
    --jobs 2."""
    nbs = tmp_path / "notebooks"
    cell = ("import json, os, time, pathlib\nout = pathlib.Path(os.environ['COURSE_BUILD_DIR']) / 'spans'\n"
            "out.mkdir(parents=True, exist_ok=True); t = time.time(); (out / '{0}.start').touch()\n"
            "while {1!r} and not (out / '{1}.start').exists() and time.time() < t + 120: time.sleep(0.2)\n"
            "assert not {1!r} or (out / '{1}.start').exists(), 'ran alone'\ntime.sleep(1)\n"
            "(out / '{0}.json').write_text(json.dumps([t, time.time()]))")
    partner = {"03_a": "06_b", "06_b": "03_a"}  # each waits for the other to start: they run side by side or fail
    for stem in ("02_alone", "03_a", "06_b", "07_reads_06"):
        _notebook(nbs / f"{stem}.ipynb", 'profile = "auto"', ("code", cell.format(stem, partner.get(stem, ""))))
    with _inside(tmp_path):
        outcomes = runner.run("cpu", jobs=2)
        with pytest.raises(ValueError, match="--jobs"):
            runner.run("gpu", jobs=2)
    assert [(o.notebook, o.status) for o in outcomes] == [(s, "ok") for s in ("02_alone", "03_a", "06_b", "07_reads_06")]
    span = {p.stem[:2]: json.loads(p.read_text()) for p in (tmp_path / "build" / "spans").glob("*.json")}
    overlap = lambda a, b: span[a][0] < span[b][1] and span[b][0] < span[a][1]  # noqa: E731
    assert overlap("03", "06") and span["07"][0] >= span["06"][1]
    assert all(span["02"][0] >= span[o][1] for o in ("03", "06", "07"))
