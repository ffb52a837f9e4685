"""JupyterLab as learners use it: started like `make lab`, driven by headless Chromium.

One JupyterLab server (course_lib.workbook.lab.lab_command, the command `make lab` runs) serves a temporary
copy of notebooks/ (Lab autosaves outputs into what it opens) on 127.0.0.1, a free port and a random
token. Against it:

- chapter 00 runs in the browser, its memory calculator renders, ZeRO stage 0 -> 3 and ranks 1 -> 8
  change the displayed per-GPU figure to what course_lib's calculator gives (screenshot in build/);
- without the token nothing is served: no notebook, no kernel, /lab redirects to the login page;
- the server listens on loopback addresses only;
- the course kernel is registered and every notebook names it; the widget extension is loaded.

The browser is Debian's Chromium (/usr/bin/chromium, installed by .ci/run) driven by Python
Playwright; without it the browser test skips and says exactly why. The rest needs no browser.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path

import pytest

from course_lib.workbook.lab import lab_command
from course_lib.workbook.launch import free_port
from course_lib.paths import REPO_ROOT, build_dir
from course_lib.paths import all_notebooks

# Waits are sized for a loaded machine (make test runs another test beside this one, on 2 cores): they bound a
# hang, not a speed, and a healthy run passes them in seconds.
pytestmark = [pytest.mark.browser, pytest.mark.timeout(600),
              pytest.mark.xdist_group("browser")]  # one worker: one lab and one browser for the module

CHROMIUM = Path(os.environ.get("COURSE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium")
KERNEL = "llm-course"
CHAPTER = "00_where_does_the_memory_go.ipynb"
NEW_SETUP = {"zero_stage": 3, "ranks": 8}


class Lab:
    def __init__(self, url: str, token: str, proc: subprocess.Popen, root: Path, log: Path):
        self.url, self.token, self.proc, self.root, self.log = url, token, proc, root, log

    def get(self, path: str, token: bool = True, method: str = "GET") -> tuple[int, str, str]:
        """(status, final URL, body) of a request, with or without the token; redirects followed."""
        sep = "&" if "?" in path else "?"
        url = self.url + path + (f"{sep}token={self.token}" if token else "")
        data = b'{"name": "llm-course"}' if method == "POST" else None
        req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=20) as r:
                return r.status, r.geturl(), r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, url, e.read().decode(errors="replace")


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab on a copy of notebooks/, started exactly as `make lab` starts it."""
    root = tmp_path_factory.mktemp("lab") / "notebooks"
    shutil.copytree(REPO_ROOT / "notebooks", root, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    token, port = secrets.token_hex(24), free_port()
    argv, env = lab_command(token, port, root=root)
    # the chapters run here write their ledgers and figures into a build of their own: the real build's ledgers are
    # the chapters' runs with their solutions (in CI, the image test's, which tests/test_notebooks.py then checks)
    env = {**env, "COURSE_BUILD_DIR": str(root.parent / "build")}
    assert not any(token in arg for arg in argv), "the token must not appear on the command line"
    log = root.parent / "lab.log"
    with log.open("w") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=root)
    server = Lab(f"http://127.0.0.1:{port}", token, proc, root, log)
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            pytest.fail(f"jupyter lab exited with {proc.returncode}:\n{log.read_text()[-2000:]}")
        try:
            if server.get("/api/status")[0] == 200:
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"jupyter lab did not answer within 60 s:\n{log.read_text()[-2000:]}")
        time.sleep(0.5)
    yield server
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


# ---------------------------------------------------------------- no token, no service

def test_requests_without_token_are_refused(lab):
    status, _, body = lab.get(f"/api/contents/{CHAPTER}", token=False)
    assert status == 403 and '"cells"' not in body, f"notebook served without a token: {status}"
    status, _, body = lab.get("/api/kernels", token=False, method="POST")
    assert status == 403 and '"id"' not in body, f"kernel started without a token: {status}"
    status, _, _ = lab.get("/api/kernels", token=False)
    assert status == 403, f"kernel list served without a token: {status}"
    status, final, body = lab.get("/lab", token=False)
    assert "/login" in final and "jupyter-config-data" not in body, f"/lab served without a token ({final})"
    status, _, body = lab.get(f"/api/contents/{CHAPTER}?token={'0' * 48}", token=False)
    assert status == 403, "a wrong token was accepted"
    # ... and with the token the same requests work (the refusals above are about the token)
    assert lab.get(f"/api/contents/{CHAPTER}")[0] == 200


def _listening(proc) -> list:
    import psutil

    connections = getattr(proc, "net_connections", None) or proc.connections  # psutil < 6 names it `connections`
    return [c.laddr for c in connections(kind="inet") if c.status == psutil.CONN_LISTEN]


def test_server_and_kernels_listen_on_loopback_only(lab):
    """The server, and a kernel it starts (its ZMQ ports), listen on 127.0.0.1 / ::1 and nowhere else."""
    import psutil

    server = psutil.Process(lab.proc.pid)
    status, _, body = lab.get("/api/kernels", method="POST")
    assert status in (200, 201), f"could not start a kernel with the token: {status} {body[:200]}"
    kernel_id = json.loads(body)["id"]
    try:
        deadline = time.monotonic() + 120
        while not any(_listening(k) for k in server.children(recursive=True)):  # the kernel binds its 5 ports
            assert time.monotonic() < deadline, "the kernel opened no port within 120 s"
            time.sleep(0.3)
        listening = {str(p.pid): _listening(p) for p in [server, *server.children(recursive=True)]}
        assert listening[str(server.pid)], "found no listening socket of the server"
        exposed = {pid: [a for a in addrs if a.ip not in ("127.0.0.1", "::1")] for pid, addrs in listening.items()}
        assert not any(exposed.values()), f"listening beyond loopback (pid: addresses): {exposed}"
    finally:
        lab.get(f"/api/kernels/{kernel_id}", method="DELETE")


# ---------------------------------------------------------------- every notebook opens

def test_course_kernel_and_widgets_are_installed(lab):
    specs = json.loads(lab.get("/api/kernelspecs")[2])["kernelspecs"]
    assert KERNEL in specs, f"kernel {KERNEL!r} not registered (have {sorted(specs)}): run `make install`"
    assert specs[KERNEL]["spec"]["display_name"] == "Python (LLM course)"
    page = lab.get("/lab")[2]
    found = re.search(r'<script id="jupyter-config-data"[^>]*>(.*?)</script>', page, re.S)
    assert found, "the /lab page carries no jupyter-config-data"
    config = json.loads(found.group(1))
    extensions = {e["name"] for e in config.get("federated_extensions", [])}
    assert "@jupyter-widgets/jupyterlab-manager" in extensions, \
        f"the ipywidgets extension is not loaded (have {sorted(extensions)}): widgets would not render"


@pytest.mark.parametrize("notebook", [p.name for p in all_notebooks()])
def test_notebook_names_the_course_kernel(lab, notebook):
    """Lab shows "Kernel not found" exactly when a notebook's kernelspec name is not registered."""
    status, _, body = lab.get(f"/api/contents/{notebook}")
    assert status == 200, f"{notebook}: {status}"
    spec = json.loads(body)["content"]["metadata"].get("kernelspec", {})
    assert spec.get("name") == KERNEL, f"{notebook} names kernel {spec.get('name')!r}, not {KERNEL!r}"


# ---------------------------------------------------------------- chapter 00 in a real browser

@pytest.fixture(scope="module")
def browser():
    reason = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as e:
        reason = f"Python Playwright is not installed ({e}): `pip install -e .[test]`"
    if reason is None and not CHROMIUM.exists():
        reason = f"no Chromium at {CHROMIUM}: install Debian's `chromium` package (.ci/run does it)"
    if reason:
        warnings.warn(f"BROWSER TEST SKIPPED: {reason}")
        pytest.skip(f"BROWSER TEST SKIPPED: {reason}")
    with sync_playwright() as pw:
        try:
            args = ["--no-sandbox"] if os.geteuid() == 0 else []  # Chromium refuses root without it
            chromium = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=args)
        except Exception as e:  # noqa: BLE001 - any launch failure means: no browser here
            reason = f"Chromium at {CHROMIUM} did not start: {str(e).splitlines()[0]}"
            warnings.warn(f"BROWSER TEST SKIPPED: {reason}")
            pytest.skip(f"BROWSER TEST SKIPPED: {reason}")
        yield chromium
        chromium.close()


def _click_if_there(button) -> None:
    """Click a button that may be sliding in or already gone (a toast animates, and Lab replaces it): a few
    seconds' try. Dismissing is not what the test checks; what it checks comes after, with its own waits."""
    from playwright.sync_api import Error as PlaywrightError

    try:
        if button.count() and button.first.is_visible():
            button.first.click(timeout=5_000)
    except PlaywrightError:  # moved or detached meanwhile (a busy machine slows the animation): nothing to dismiss
        pass


def _dismiss(page) -> None:
    """Lab 4's first-run interruptions: the "Select Kernel" dialog and the news toast."""
    dialog = page.locator(".jp-Dialog")
    if dialog.count() and dialog.first.is_visible():
        dialog.locator("button.jp-mod-accept").first.click()
    _click_if_there(page.locator(".jp-toast-button", has_text=re.compile(r"^\s*No\s*$")))
    for close in page.locator(".Toastify__close-button").all():
        _click_if_there(close)


@pytest.mark.slow
def test_chapter_00_calculator_in_browser(lab, browser):
    from course_lib.workbook.widgets import plan_for, total_label

    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{lab.url}/lab/tree/{CHAPTER}?token={lab.token}")
    page.locator(".jp-NotebookPanel").first.wait_for(timeout=120_000)
    # wait for the kernel (a "Select Kernel" dialog, if Lab shows one, must be accepted first)
    kernel_name = page.locator(".jp-NotebookPanel-toolbar .jp-KernelName").first
    idle = page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']")
    deadline = time.monotonic() + 180
    while not (idle.count() and kernel_name.inner_text().strip() == "Python (LLM course)"):
        dialog = page.locator(".jp-Dialog")
        if dialog.count():
            text = dialog.first.inner_text()
            assert "not found" not in text.lower(), f"JupyterLab says: {text}"
        _dismiss(page)
        assert time.monotonic() < deadline, f"the course kernel did not start within 180 s ({kernel_name.inner_text()})"
        page.wait_for_timeout(500)

    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).first.click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).first.click()
    total = page.locator(".memory-total")
    total.first.wait_for(timeout=300_000)  # Run All: the chapter's cells above the calculator run first
    _dismiss(page)

    def shown_setup() -> dict:
        select = lambda cls: page.locator(f".calc-{cls} select").first.evaluate("s => s.options[s.selectedIndex].text")
        number = lambda cls: int(page.locator(f".calc-{cls} input").first.input_value())
        return dict(model=select("model"), precision=select("precision"), optimizer=select("optimizer"),
                    zero_stage=int(select("zero-stage")), ranks=number("ranks"), seq=number("seq"),
                    batch=number("batch"), checkpointing=page.locator(".calc-checkpointing input").first.is_checked())

    def expected(setup: dict) -> str:
        setup = dict(setup)
        return total_label(plan_for(setup.pop("model"), **setup))

    before = shown_setup()
    assert (before["zero_stage"], before["ranks"]) == (0, 1), f"unexpected starting setup {before}"
    page.wait_for_function("e => e.textContent.includes('per GPU')", arg=total.first.element_handle())
    assert total.first.inner_text().strip() == expected(before)

    chart = page.locator(".widget-hbox:has(.memory-total) .widget-output img").first
    chart.wait_for(timeout=120_000)

    def redrawn_after(change) -> None:
        """Make a change, then wait until the kernel has drawn a new bar chart (it redraws on every change)."""
        old = chart.get_attribute("src")
        change()
        page.wait_for_function("old => { const i = document.querySelector('.widget-hbox .widget-output img');"
                               " return i && i.complete && i.src != old; }", arg=old, timeout=120_000)

    redrawn_after(lambda: page.locator(".calc-zero-stage select").first.select_option(label=str(NEW_SETUP["zero_stage"])))
    ranks = page.locator(".calc-ranks input").first
    redrawn_after(lambda: (ranks.fill(str(NEW_SETUP["ranks"])), ranks.press("Enter")))
    after = shown_setup()
    assert (after["zero_stage"], after["ranks"]) == (NEW_SETUP["zero_stage"], NEW_SETUP["ranks"])
    want = expected(after)
    assert want != expected(before), "the change should move the figure"
    page.wait_for_function("([e, want]) => e.textContent.trim() == want", arg=[total.first.element_handle(), want],
                           timeout=60_000)
    assert total.first.inner_text().strip() == want
    assert not page.locator("text=Error displaying widget").count(), "a widget failed to render"

    widget = page.locator(".widget-hbox", has=page.locator(".memory-total")).first
    widget.scroll_into_view_if_needed()
    _dismiss(page)
    shots = [build_dir() / "browser" / "00_calculator.png", build_dir() / "figures" / "00_browser_calculator.png"]
    for shot in shots:
        shot.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(shots[0]))
    widget.screenshot(path=str(shots[1]))
    assert not [e for e in errors if "widget" in e.lower()], f"widget errors in the page: {errors}"
    page.close()
