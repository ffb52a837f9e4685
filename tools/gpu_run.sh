#!/usr/bin/env bash
# One command for a bare CUDA machine (the device tool's H200): every chapter, GPU profile, 480 s budget,
# one archive in $OUT. Details and options: tools/gpu_run.py. Carry .whl/ (`make gpu-wheels`) with it.
#   bash tools/gpu_run.sh [--profile cpu] [--only 03,05] [--budget 480]
exec "${PYTHON:-python3}" "$(dirname "$0")/gpu_run.py" "$@"
