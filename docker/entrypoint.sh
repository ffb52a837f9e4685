#!/usr/bin/env bash
# The course image's entry point (docker/Dockerfile):
#   lab            JupyterLab behind a token (JUPYTER_TOKEN, JUPYTER_TOKEN_FILE, or generated and printed once)
#   test [--no-check] [--only 03,05] [--jobs 2] [--solutions]   check the image on its hardware (not with
#                  --no-check), then run the whole workbook headless with its profile (PROFILE: gpu, or cpu in the
#                  CPU image; --jobs 2 on the CPU: two chapters at a time); exit non-zero if a chapter or the check
#                  failed (ONLY=03,05 in the environment works too)
#   check          the image checks alone, on the GPU or the CPU (docker/check_image.py --run)
#   anything else  run as given: bash, torchrun ..., deepspeed --hostfile ..., python -m ...
set -euo pipefail
cd /workspace

writable_build() {
    if ! touch build/.writable 2>/dev/null; then
        echo "error: /workspace/build is not writable by uid $(id -u): on the host, \`mkdir -p build\`" \
             "and give it to that uid (or build the image with --build-arg COURSE_UID=\$(id -u))" >&2
        exit 2
    fi
    rm -f build/.writable
}

command="${1:-lab}"
[ "$#" -gt 0 ] && shift
case "$command" in
    lab)
        # 0.0.0.0 inside the container, so that the published port reaches it; the token is always
        # required, and compose publishes the port on the host's 127.0.0.1 only.
        exec python -m course_lib.workbook.lab --ip 0.0.0.0 --port "${LAB_PORT:-8888}" "$@"
        ;;
    test)
        writable_build
        profile="${PROFILE:-gpu}"
        checked=0
        # a failed check (say, TensorFlow's cuDNN) still lets every chapter run and report; --no-check: the chapters
        # alone (the image test runs `check` on its own, through compose)
        if [ "${1:-}" = --no-check ]; then shift; else python docker/check_image.py --run || checked=$?; fi
        ran=0
        python -m course_lib.workbook.runner --profile "$profile" "$@" || ran=$?
        if [ "$checked" != 0 ] && [ "$ran" = 0 ]; then
            echo "the chapters passed, but the image check failed (see its FAIL lines above)" >&2
            exit "$checked"
        fi
        exit "$ran"
        ;;
    check)
        exec python docker/check_image.py --run "$@"
        ;;
    *)
        exec "$command" "$@"
        ;;
esac
