#!/usr/bin/env bash
# One command for an offline GPU machine: the chapters that never ran on a GPU (gpu_run.py's PLANS["1"]), gpu profile,
# done within 600 s (--limit: give the machine's timeout_s), the log and one archive in $OUT (refreshed as each
# chapter ends and as each running chapter's ledger gains a row). The second command: `--plan 2` (10, 03, 04, 01; with
# `--limit <seconds left>` when it shares the window). COURSE_COMMIT=<sha>: the commit the copied tree is. Details and
# options: tools/gpu_run.py. Carry .whl/ with it (`make gpu-wheels`: the wheels it lacks and Qwen's tokenizer).
#   bash tools/gpu_run.sh [--plan 1|2] [--limit 600] [--profile cpu] [--only 03,05] [--budget 420] [--chapter-cap 0]
exec "${PYTHON:-python3}" "$(dirname "$0")/gpu_run.py" "$@"
