#!/usr/bin/env bash
# The lower bound of the supported range, run: torch, transformers, peft, DeepSpeed, accelerate, tokenizers and
# datasets at the lowest version pyproject.toml allows (read from it here, so the check cannot drift from what it
# claims), the rest of what the chapters and tests need as pip resolves it within pyproject's bounds, in a throwaway
# venv. Then the fast unit tests run in it, and every chapter, through the one command a GPU machine runs
# (tools/gpu_run.sh, cpu profile, claims recorded, kernels that venv's Python).
# Prints one PASSED/FAILED line; exits non-zero on failure. CI runs it.
#
#   tools/check_min_versions.sh            # venv in build/minver-venv, rebuilt only when its requirements change
#   CHAPTERS=03,10 tools/check_min_versions.sh  # those chapters only; CHAPTERS=none: unit tests only
#   VENV_ONLY=1 tools/check_min_versions.sh  # build the venv and stop (CI does this beside `make install`)
#
# Not installed: TensorFlow/Keras (optional at run time: chapter 03's TensorFlow section prints SKIPPED), JupyterLab,
# the book's tools and the browser/Docker test tools; the tests that need them are left out (TEST_IGNORE below).
# torch's floor must be a build pip can install here: the CPU wheel on this machine's disk is 2.13.0, for Python 3.11.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
VENV=${VENV:-build/minver-venv}
PYTHON=${PYTHON:-python3}
CHAPTERS=${CHAPTERS-}   # empty: every chapter; `none`: unit tests only
# Left out of the unit tests, with why: they need what this venv does not install, or are not about library APIs.
TEST_IGNORE=(
    tests/test_browser.py tests/test_book.py   # Chromium/Playwright, nbconvert and MathJax
    tests/test_docker.py tests/test_gpu_ready.py   # Docker; hadolint, the wheel tools and TensorFlow-less runs
    tests/test_notebooks.py tests/test_prose.py    # the chapters (run below) and their text: library-independent
    tests/test_repo.py   # the repository's own files (pyproject, Dockerfile, environment.yml) agree
)
# TensorFlow's own tests: this venv leaves TensorFlow out on purpose (under CI their skip would count as a failure)
TEST_DESELECT=(tests/test_precision.py::test_keras_dtype_audit_flags tests/test_quiet.py::test_tensorflow_imports_without_its_banner)
started=$(date +%s)
took() { echo "== check_min_versions: $1 in $(( $(date +%s) - started )) s"; started=$(date +%s); }

mkdir -p build
req=build/minver-requirements.txt
"$PYTHON" - "$req" <<'EOF'
import re
import sys
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
# at their floors: the libraries whose APIs the course calls
FLOORED = ("torch", "transformers", "peft", "deepspeed", "accelerate", "tokenizers", "datasets")
# within pyproject's bounds, as pip resolves them: what chapters 03, 10, 11 and the unit tests import
OTHERS = ("numpy", "matplotlib", "tqdm", "psutil", "tensorboard", "bitsandbytes", "ipykernel", "ipywidgets",
          "papermill", "nbformat", "pytest", "pytest-timeout", "pytest-xdist")


def numbers(version):
    return [int(x) for x in re.findall(r"\d+", version)]


bounds = {}
for req in project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]:
    name, spec = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[[^]]*\])?\s*([^;]*)", req).groups()
    bounds.setdefault(name.lower(), []).extend(s.strip() for s in spec.split(",") if s.strip())
lines = [f"# {sys.version.split()[0]}: the Python this venv is built with"]
for name in FLOORED + OTHERS:
    if name not in bounds:
        sys.exit(f"error: pyproject.toml does not list {name}")
    if name in OTHERS:
        lines.append(name + ",".join(dict.fromkeys(bounds[name])))  # every extra's bounds at once
        continue
    floors = [s.lstrip(">=") for s in bounds[name] if s.startswith((">=", "=="))]
    if not floors:
        sys.exit(f"error: pyproject.toml gives {name} no lower bound: nothing to check")
    lines.append(f"{name}=={max(floors, key=numbers)}")
open(sys.argv[1], "w").write("\n".join(lines) + "\n")
EOF
echo "== requirements (floors from pyproject.toml):"; sed 's/^/  /' "$req"

if [ ! -x "$VENV/bin/python" ] || ! cmp -s "$req" "$VENV/.requirements"; then
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    # DeepSpeed is an sdist: built without its ops, as the Docker image does
    DS_BUILD_OPS=0 "$VENV/bin/python" -m pip install -q -r "$req"
    "$VENV/bin/python" -m ipykernel install --sys-prefix --name llm-course --display-name "Python (LLM course, oldest versions)" >/dev/null
    cp "$req" "$VENV/.requirements"
    took "venv built"
fi
if [ -n "${VENV_ONLY:-}" ]; then exit 0; fi
echo "== installed:"
"$VENV/bin/python" - <<'EOF'
from importlib import metadata
for p in ("torch", "transformers", "peft", "deepspeed", "accelerate", "tokenizers", "datasets", "huggingface-hub",
          "safetensors", "numpy", "bitsandbytes", "tensorflow", "keras"):
    try:
        print(f"  {p:16s} {metadata.version(p)}")
    except metadata.PackageNotFoundError:
        print(f"  {p:16s} (not installed)")
EOF

VENV=$(cd "$VENV" && pwd)
# the repo's course_lib; this venv's kernel ahead of any other `llm-course` kernel
export PYTHONPATH=$REPO JUPYTER_PATH=$VENV/share/jupyter COURSE_BUILD_DIR=$REPO/build/minver
rm -rf "$COURSE_BUILD_DIR"; mkdir -p "$COURSE_BUILD_DIR"
status=0
echo "== unit tests (not slow, notebook, browser or docker):"
"$VENV/bin/python" -m pytest tests -q -p no:cacheprovider -n 2 --dist loadgroup \
    -m "not slow and not notebook and not browser and not docker" \
    "${TEST_IGNORE[@]/#/--ignore=}" "${TEST_DESELECT[@]/#/--deselect=}" || status=$?
took "unit tests"
if [ "$CHAPTERS" != none ]; then
    # the one command an offline GPU machine runs, on this CPU: every chapter to its end, claims recorded rather than
    # asserted (a lower version may measure differently; what must hold is that each chapter runs), solutions filled
    echo "== chapters ${CHAPTERS:-all}, through tools/gpu_run.sh, cpu profile, claims recorded, with their solutions:"
    PYTHON="$VENV/bin/python" bash tools/gpu_run.sh --profile cpu ${CHAPTERS:+--only "$CHAPTERS"} --budget 3600 \
        --chapter-cap 0 --wheels "$COURSE_BUILD_DIR/no-wheels" --work "$COURSE_BUILD_DIR/gpu-run" \
        --out "$COURSE_BUILD_DIR/gpu-out" || status=$?
    took "chapters"
fi
echo "== check_min_versions: $([ $status = 0 ] && echo PASSED || echo "FAILED (exit $status)")"
exit $status
