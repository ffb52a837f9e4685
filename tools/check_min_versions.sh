#!/usr/bin/env bash
# Does the course run on the oldest stack it supports (torch 2.11, transformers 5.17), and without TensorFlow?
#
# Checked for real, not by reading changelogs: a throwaway venv on Python 3.12 with the lent GPU machine's
# versions (the `name==version` lines of tools/gpu_device.txt: torch 2.11.0 from PyPI, which is the CUDA build
# and runs on a CPU too, transformers 5.17.0, accelerate, tokenizers, safetensors, huggingface-hub, numpy),
# the rest of pyproject's dependencies as pip resolves them, and no TensorFlow/Keras. Then the unit tests that
# touch torch/transformers/peft/DeepSpeed APIs run in it, and (CHAPTERS, default 00,07,09) whole chapters with
# the CPU profile, their kernel being that venv's Python.
#
#   tools/check_min_versions.sh                  # venv in build/minver-venv (about 6 GB, reused on later runs)
#   VENV=/tmp/v CHAPTERS= tools/check_min_versions.sh     # no chapters, unit tests only
#
# Needs python3.12 (PYTHON312 names another) and PyPI. What it cannot check: CUDA code paths (no GPU here),
# and peft's version on the GPU machine (its docs give none; pyproject's bound is used).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
VENV=${VENV:-build/minver-venv}
PY312=${PYTHON312:-}
for cand in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do   # a pyenv shim may exist and refuse
    [ -n "$PY312" ] && break
    if "$cand" -c "" 2>/dev/null; then PY312=$cand; fi
done
[ -n "$PY312" ] || { echo "error: no working python3.12 (set PYTHON312)"; exit 2; }
CHAPTERS=${CHAPTERS-00,07,09}
TESTS=${TESTS:-tests/test_course_lib.py tests/test_precision.py tests/test_checkpoint.py tests/test_parallel.py
       tests/test_train.py tests/test_chat_masks.py tests/test_zero.py}

mkdir -p build
req=build/minver-requirements.txt
con=build/minver-constraints.txt
# pyproject's dependencies without TensorFlow/Keras/JupyterLab and without the torch pin (the constraint sets it)
"$PY312" - "$req" "$con" <<'EOF'
import re, sys, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]
test = [d for d in deps["optional-dependencies"]["test"] if re.split(r"[<>=!~ \[]", d)[0] in ("pytest", "pytest-timeout")]
keep = [d for d in deps["dependencies"] + test if re.split(r"[<>=!~ \[]", d)[0] not in ("torch", "keras", "jupyterlab")]
pins = [ln.strip() for ln in open("tools/gpu_device.txt") if "==" in ln and not ln.startswith("#")]
wanted = {"torch", "transformers", "accelerate", "tokenizers", "safetensors", "huggingface-hub", "numpy", "triton"}
open(sys.argv[1], "w").write("\n".join(["torch"] + keep) + "\n")
open(sys.argv[2], "w").write("\n".join(p for p in pins if p.split("==")[0] in wanted) + "\n")
EOF
echo "== constraints (the GPU machine's versions):"; cat "$con"

if [ ! -x "$VENV/bin/python" ] || ! cmp -s "$req" "$VENV/.requirements" || ! cmp -s "$con" "$VENV/.constraints"; then
    rm -rf "$VENV"
    "$PY312" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # DeepSpeed is an sdist: build it without ops (as the Docker image and .whl/ do); a wheel in .whl/ is reused
    DS_BUILD_OPS=0 "$VENV/bin/python" -m pip install -q $(ls .whl/deepspeed-*.whl 2>/dev/null | head -1) \
        -r "$req" -c "$con" ipykernel
    "$VENV/bin/python" -m ipykernel install --sys-prefix --name llm-course --display-name "Python (LLM course, min versions)" >/dev/null
    cp "$req" "$VENV/.requirements"; cp "$con" "$VENV/.constraints"
fi
echo "== installed:"
"$VENV/bin/python" - <<'EOF'
from importlib import metadata
for p in ("torch", "transformers", "accelerate", "tokenizers", "huggingface-hub", "peft", "deepspeed", "datasets", "numpy", "tensorflow", "keras"):
    try:
        print(f"  {p:16s} {metadata.version(p)}")
    except metadata.PackageNotFoundError:
        print(f"  {p:16s} (not installed)")
EOF

VENV=$(cd "$VENV" && pwd)
export PYTHONPATH=$REPO COURSE_BUILD_DIR=$REPO/build/minver JUPYTER_PATH=$VENV/share/jupyter  # this venv's kernel first
rm -rf "$COURSE_BUILD_DIR"; mkdir -p "$COURSE_BUILD_DIR"
status=0
echo "== unit tests on the oldest supported stack:"
# shellcheck disable=SC2086
"$VENV/bin/python" -m pytest $TESTS -q -p no:cacheprovider -m "not notebook and not browser" || status=$?
if [ -n "$CHAPTERS" ]; then
    echo "== chapters $CHAPTERS, cpu profile, kernel = this venv's Python:"
    "$VENV/bin/python" -m course_lib.runner --profile cpu --only "$CHAPTERS" || status=$?
fi
echo "== check_min_versions: $([ $status = 0 ] && echo PASSED || echo "FAILED (exit $status)")"
exit $status
