#!/usr/bin/env bash
# One command for an offline GPU machine: the chapters in turn, gpu profile, 420 s of chapter work, the log and one
# archive in $OUT (refreshed as each chapter ends). Details and options: tools/gpu_run.py. Carry .whl/ with it
# (`make gpu-wheels`: the wheels it lacks and Qwen's tokenizer).
#   bash tools/gpu_run.sh [--profile cpu] [--only 03,05] [--budget 420] [--chapter-cap 0]
exec "${PYTHON:-python3}" "$(dirname "$0")/gpu_run.py" "$@"
